"""Demo: the op on synthetic logits vs the float64 reference, with errors and timings.

    python -m jaxops.demo [--tokens T] [--vocab V]

Sizes default to a realistic RL batch on GPU (T = 8192, V = 151,936) and are
scaled down on CPU, where the Pallas kernels run in interpret mode. On a GPU, `plan`
sizes the run from the device's free memory: T shrinks (by powers of two) only where
the timed programs would not fit (a 16 GB card), and the float64 reference, which
needs ~8x the memory of the fp32 logits, is computed in blocks of rows and compared
block by block, so the timings keep T = 8192 on an 80 GB H100 and a 141 GB H200.

Every array reaches the jitted programs below as an argument, never as a value
closed over by a Python function: a captured array is baked into the program as a
constant (at the GPU size the 1.2 GB keep mask made each masked program 2.5 GB of
HLO text and ~46 s of compilation). `tests/repo/test_no_large_constants.py` checks it.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxops

TIMING_REPEATS = 5
CPU_TIMING_REPEATS = 2  # interpret-mode Pallas takes seconds per call; CPU timings are a sketch
GPU_TOKENS, GPU_VOCAB = 8192, 151_936
CPU_TOKENS, CPU_VOCAB = 128, 32_000

# Bytes per logit element, estimated from XLA's memory analysis of these programs
# (`.lower(...).compile().memory_analysis()`) with margin:
# - held through a (dtype, mask) group of steps: the fp32 logits (4), the keep mask (1),
#   the logits in the step's dtype (<= 4) and both implementations' gradients (<= 8);
HELD_BYTES = 17
# - while a timed implementation runs: its workspace (the XLA path's masked bf16
#   backward needs ~13), on top of HELD_BYTES;
TIMED_BYTES = 16
# - per row of a float64 reference block: its float64 logits (8), mask slice (1),
#   float64 gradient (8), the reference's workspace (~33) and the float64 difference
#   of the gradients (8).
REFERENCE_BYTES = 60
MEMORY_FRACTION = 0.85  # of the free device memory the plan may use
MIN_REFERENCE_ROWS = 16  # where a given --tokens leaves no room, blocks this small


class Plan(NamedTuple):
    """The demo's sizes: `tokens` rows are timed; the float64 reference is computed and
    compared `reference_rows` rows at a time."""
    tokens: int
    reference_rows: int


def _pow2_floor(n):
    return 1 << (max(int(n), 1).bit_length() - 1)


def plan(num_vocab, free_bytes, *, tokens=None, on_gpu=True):
    """The demo's sizes for `num_vocab` and `free_bytes` of free device memory (None where
    the device does not report it, as on CPU). `tokens` (the user's --tokens) is kept as
    given; otherwise T is GPU_TOKENS (CPU_TOKENS on CPU), halved until the timed programs
    fit. The reference block is the largest power of two (at most T) that fits next to
    what the timed steps hold."""
    default = GPU_TOKENS if on_gpu else CPU_TOKENS
    if free_bytes is None:  # CPU: one block; a GPU without statistics: blocks of 1024 rows
        num_tokens = tokens or default
        return Plan(num_tokens, num_tokens if not on_gpu else min(num_tokens, 1024))
    budget = MEMORY_FRACTION * free_bytes
    num_tokens = tokens
    if num_tokens is None:
        num_tokens = default
        while num_tokens > 1 and (HELD_BYTES + TIMED_BYTES) * num_tokens * num_vocab > budget:
            num_tokens //= 2
    left = budget - HELD_BYTES * num_tokens * num_vocab
    reference_rows = _pow2_floor(max(left, 0) / (REFERENCE_BYTES * num_vocab))
    reference_rows = min(num_tokens, max(MIN_REFERENCE_ROWS, reference_rows))
    return Plan(num_tokens, reference_rows)


def free_device_bytes(device=None):
    """Bytes the device's allocator can still hand out (its limit less what is in use:
    with JAX's default preallocation the limit is 75% of the card), or None where the
    device reports no memory statistics (CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without statistics raise or return None
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def _loss(logits, targets, keep_mask, cot_lp, cot_h, *, implementation, temperature):
    """<cotangents, (log_prob, entropy)>, so that its gradient is the op's VJP."""
    log_prob, entropy = jaxops.logprob_entropy(
        logits, targets, keep_mask=keep_mask, temperature=temperature,
        implementation=implementation)
    return (jnp.sum(log_prob * cot_lp.astype(log_prob.dtype))
            + jnp.sum(entropy * cot_h.astype(entropy.dtype))), (log_prob, entropy)


@functools.partial(jax.jit, static_argnames=("implementation", "temperature"))
def forward(logits, targets, keep_mask, *, implementation, temperature):
    """(log_prob, entropy); `keep_mask` may be None."""
    return jaxops.logprob_entropy(logits, targets, keep_mask=keep_mask, temperature=temperature,
                                  implementation=implementation)


@functools.partial(jax.jit, static_argnames=("implementation", "temperature"))
def forward_backward(logits, targets, keep_mask, cot_lp, cot_h, *, implementation,
                     temperature):
    """(d logits, (log_prob, entropy)) for the cotangents (cot_lp, cot_h)."""
    return jax.grad(functools.partial(_loss, implementation=implementation,
                                      temperature=temperature), has_aux=True)(
        logits, targets, keep_mask, cot_lp, cot_h)


@functools.partial(jax.jit, static_argnames=("dtype", "temperature"))
def _reference_errors(logits32, targets, keep_mask, cot_lp, cot_h, results, *, dtype,
                      temperature):
    """For one block of rows: the float64 reference of the op on the block's logits (as
    rounded to `dtype`), and per implementation in `results` ((log_prob, entropy, grad)
    of the block) max |lp err|, max |H err|, sum (grad - ref)^2; and sum ref^2."""
    wide = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    ref_grad, (ref_lp, ref_h) = forward_backward(
        logits32.astype(dtype).astype(wide), targets, keep_mask, cot_lp, cot_h,
        implementation="reference", temperature=temperature)
    errors = [(jnp.max(jnp.abs(log_prob - ref_lp)), jnp.max(jnp.abs(entropy - ref_h)),
               jnp.sum(jnp.square(grad.astype(wide) - ref_grad)))
              for log_prob, entropy, grad in results]
    return errors, jnp.sum(jnp.square(ref_grad))


def errors_in_blocks(logits32, targets, keep_mask, cot_lp, cot_h, results, *, dtype,
                     temperature, block_rows):
    """Per implementation (max |lp err|, max |H err|, ||grad - ref|| / ||ref||) against
    the float64 reference, computed `block_rows` rows at a time (the op is row-wise, so
    each block's reference is the full reference's rows). Returns (errors, blocks)."""
    num_tokens = logits32.shape[0]
    max_lp, max_h, sq = (np.zeros(len(results)) for _ in range(3))
    ref_sq, blocks = 0.0, 0
    for start in range(0, num_tokens, block_rows):
        rows = slice(start, min(start + block_rows, num_tokens))
        block = [tuple(x[rows] for x in result) for result in results]
        errors, block_ref_sq = _reference_errors(
            logits32[rows], targets[rows], None if keep_mask is None else keep_mask[rows],
            cot_lp[rows], cot_h[rows], block, dtype=dtype, temperature=temperature)
        for i, (err_lp, err_h, err_sq) in enumerate(errors):
            max_lp[i] = max(max_lp[i], float(err_lp))
            max_h[i] = max(max_h[i], float(err_h))
            sq[i] += float(err_sq)
        ref_sq += float(block_ref_sq)
        blocks += 1
    return [(max_lp[i], max_h[i], float(np.sqrt(sq[i] / ref_sq)))
            for i in range(len(results))], blocks


def make_inputs(num_tokens, num_vocab, seed=0):
    """fp32 logits [T, V], targets [T], a ~2% keep mask [T, V] and cotangents [T] x 2."""
    key_logits, key_targets, key_mask, key_cot = jax.random.split(jax.random.key(seed), 4)
    # Logits like a language model's: a heavy tail of unlikely tokens, a few likely ones.
    logits32 = 4.0 * jax.random.normal(key_logits, (num_tokens, num_vocab), jnp.float32)
    targets = jax.random.randint(key_targets, (num_tokens,), 0, num_vocab)
    keep_mask = jax.random.uniform(key_mask, (num_tokens, num_vocab)) < 0.02
    cot_lp, cot_h = jax.random.normal(key_cot, (2, num_tokens), jnp.float32)
    return logits32, targets, keep_mask, cot_lp, cot_h


def _timed(fn, *args, warm=False, repeats=None, **kwargs):
    """Median wall time in ms of `repeats` (default TIMING_REPEATS) calls (one more first
    unless already `warm`)."""
    repeats = repeats or TIMING_REPEATS
    if not warm:
        jax.block_until_ready(fn(*args, **kwargs))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def _progress(message, **kwargs):
    print(message, file=sys.stderr, flush=True, **kwargs)


def main(argv=None):
    jax.config.update("jax_enable_x64", True)

    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"T (default {GPU_TOKENS} on GPU, fewer where memory is short; "
                             f"{CPU_TOKENS} on CPU)")
    parser.add_argument("--vocab", type=int, default=GPU_VOCAB if on_gpu else CPU_VOCAB)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)
    num_vocab, tau = args.vocab, args.temperature
    free = free_device_bytes() if on_gpu else None
    num_tokens, reference_rows = plan(num_vocab, free, tokens=args.tokens, on_gpu=on_gpu)
    repeats = TIMING_REPEATS if on_gpu else min(TIMING_REPEATS, CPU_TIMING_REPEATS)

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; T = {num_tokens}, "
          f"V = {num_vocab}, temperature = {tau}"
          + ("" if on_gpu else " (scaled down on CPU; Pallas runs in interpret mode)"),
          flush=True)
    if free is not None:
        print(f"{free / 2**30:.1f} GiB free on the device: float64 reference in blocks of "
              f"{reference_rows} rows", flush=True)
    start = time.perf_counter()
    logits32, targets, keep_mask, cot_lp, cot_h = make_inputs(num_tokens, num_vocab)

    rows = []
    steps = [(dtype, mask, impl) for dtype in (jnp.float32, jnp.bfloat16)
             for mask in (None, keep_mask) for impl in ("pallas", "xla", "reference")]
    results = []
    for step, (dtype, mask, impl) in enumerate(steps, 1):
        dtype_name, masked = jnp.dtype(dtype).name, "yes" if mask is not None else "no"
        _progress(f"[demo {step}/{len(steps)}] {dtype_name}, mask {masked}, {impl}: "
                  + ("errors against the float64 reference" if impl == "reference"
                     else "timings"), end="")
        step_start = time.perf_counter()
        logits = logits32.astype(dtype)
        if impl == "reference":
            del logits
            errors, blocks = errors_in_blocks(
                logits32, targets, mask, cot_lp, cot_h, [r[1] for r in results], dtype=dtype,
                temperature=tau, block_rows=reference_rows)
            for (row, _), (err_lp, err_h, err_g) in zip(results, errors):
                rows.append(row[:3] + (err_lp, err_h, err_g) + row[3:])
            results = []
            _progress(f", {blocks} block{'s' if blocks > 1 else ''}", end="")
        else:
            options = dict(implementation=impl, temperature=tau)
            grad, (log_prob, entropy) = forward_backward(logits, targets, mask, cot_lp, cot_h,
                                                         **options)
            fwd_ms = _timed(forward, logits, targets, mask, repeats=repeats, **options)
            fwd_bwd_ms = _timed(forward_backward, logits, targets, mask, cot_lp, cot_h,
                                warm=True, repeats=repeats, **options)
            results.append(((dtype_name, masked, impl, fwd_ms, fwd_bwd_ms),
                            (log_prob, entropy, grad)))
            del grad, log_prob, entropy, logits
        _progress(f" ({time.perf_counter() - step_start:.1f} s)")
    _progress(f"[demo] done in {time.perf_counter() - start:.1f} s")

    header = ("dtype", "mask", "impl", "|lp err|max", "|H err|max", "grad rel err",
              "fwd ms", "fwd+bwd ms")
    print("\n" + " | ".join(f"{h:>12s}" for h in header))
    print("-" * (15 * len(header)))
    for row in rows:
        print(" | ".join(f"{v:>12s}" if isinstance(v, str) else f"{v:12.3g}" for v in row))
    print("\nErrors are against the float64 reference on the same input values; gradients in "
          "the logits' dtype\n(bf16 gradients carry one bf16 rounding, ~4e-3). Timings: median "
          f"of {repeats} jitted calls"
          + ("." if on_gpu else " (CPU; interpret-mode Pallas is slow by design)."))


if __name__ == "__main__":
    main()
