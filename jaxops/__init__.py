"""Fused vocab-parallel log-prob and entropy for RL post-training, in JAX/Pallas."""

from jaxops.api import logprob_entropy
from jaxops.backends.registry import IMPLEMENTATIONS
from jaxops.backends.registry import default as default_implementation
from jaxops.backends.triton.config import PallasConfig
from jaxops.linear import linear_logprob_entropy
from jaxops.reference import logprob_entropy_reference
from jaxops.sharding import vocab_parallel_logprob_entropy

__all__ = [
    "IMPLEMENTATIONS",
    "PallasConfig",
    "default_implementation",
    "linear_logprob_entropy",
    "logprob_entropy",
    "logprob_entropy_reference",
    "vocab_parallel_logprob_entropy",
]
