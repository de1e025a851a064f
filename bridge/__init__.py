"""PyTorch bridge to the JAX/Pallas log-prob + entropy op.

    import bridge
    log_prob, entropy = bridge.logprob_entropy(logits, targets, process_group=tp_group)
    log_prob, entropy = bridge.linear_logprob_entropy(hidden, weight, targets, ...)  # no logits

Importing `bridge` before anything starts JAX makes JAX allocate GPU memory on demand
(`XLA_PYTHON_CLIENT_PREALLOCATE=false`) instead of taking 75% of the GPU from PyTorch.
"""

from bridge import _dlpack

_dlpack.apply_memory_policy()  # before jax is imported below

from bridge._checks import check_targets  # noqa: E402
from bridge.linear import linear_logprob_entropy  # noqa: E402
from bridge.op import logprob_entropy  # noqa: E402
from bridge.slime import calculate_log_probs_and_entropy  # noqa: E402

__all__ = ["calculate_log_probs_and_entropy", "check_targets", "linear_logprob_entropy",
           "logprob_entropy"]
