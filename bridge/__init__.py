"""PyTorch bridge to the JAX/Pallas log-prob + entropy op.

    import bridge
    log_prob, entropy = bridge.logprob_entropy(logits, targets, process_group=tp_group)
    log_prob, entropy = bridge.linear_logprob_entropy(hidden, weight, targets, ...)  # no logits
    bridge.warmup(max_tokens=32768, vocab_size=V_loc)  # compile every row window up front
    bridge.diagnostics.direct_route_ready()  # internals that benchmarks report on

Importing `bridge` before anything starts JAX makes JAX allocate GPU memory on demand
(`XLA_PYTHON_CLIENT_PREALLOCATE=false`) instead of taking 75% of the GPU from PyTorch.
What the bridge compiles is kept in a persistent cache (`JAXOPS_CACHE_DIR`, default
`~/.cache/jaxops`; docs/compilation.md).
"""

from bridge import _dlpack, cache

_dlpack.apply_memory_policy()  # before jax is imported below

from bridge._checks import check_targets  # noqa: E402
from bridge.linear import linear_logprob_entropy  # noqa: E402
from bridge.op import logprob_entropy  # noqa: E402
from bridge.slime import calculate_log_probs_and_entropy  # noqa: E402
from bridge.warmup import WarmupReport, compiled_programs, warmup  # noqa: E402
from bridge import diagnostics  # noqa: E402  (after the ops: it reports on them)


def compilation_cache_dir():
    """The folder of JAX's persistent cache for the bridge's programs, or None (off, or
    not enabled yet: that happens on the bridge's first call or warm-up)."""
    return cache.directory()


__all__ = ["WarmupReport", "calculate_log_probs_and_entropy", "check_targets",
           "compilation_cache_dir", "compiled_programs", "diagnostics",
           "linear_logprob_entropy", "logprob_entropy", "warmup"]
