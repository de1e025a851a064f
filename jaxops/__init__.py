"""Fused vocab-parallel log-prob and entropy for RL post-training, in JAX/Pallas."""

from jaxops.api import IMPLEMENTATIONS, default_implementation, logprob_entropy
from jaxops.pallas_gpu import PallasConfig
from jaxops.reference import logprob_entropy_reference
from jaxops.sharding import vocab_parallel_logprob_entropy

__all__ = [
    "IMPLEMENTATIONS",
    "PallasConfig",
    "default_implementation",
    "logprob_entropy",
    "logprob_entropy_reference",
    "vocab_parallel_logprob_entropy",
]
