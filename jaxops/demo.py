"""Demo: the op on synthetic logits vs the float64 reference, with errors and timings.

    python -m jaxops.demo [--tokens T] [--vocab V]

Sizes default to a realistic RL batch on GPU (T = 8192, V = 151,936) and are
scaled down on CPU, where the Pallas kernels run in interpret mode.

Every array reaches the jitted programs below as an argument, never as a value
closed over by a Python function: a captured array is baked into the program as a
constant (at the GPU size the 1.2 GB keep mask made each masked program 2.5 GB of
HLO text and ~46 s of compilation). `tests/test_no_large_constants.py` checks it.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxops

TIMING_REPEATS = 5


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


@jax.jit
def _errors(log_prob, entropy, grad, ref_lp, ref_h, ref_grad):
    """max |lp err|, max |H err|, ||grad - ref|| / ||ref|| (in float64 where enabled)."""
    wide = ref_grad.dtype
    return (jnp.max(jnp.abs(log_prob - ref_lp)), jnp.max(jnp.abs(entropy - ref_h)),
            jnp.linalg.norm(grad.astype(wide) - ref_grad) / jnp.linalg.norm(ref_grad))


def make_inputs(num_tokens, num_vocab, seed=0):
    """fp32 logits [T, V], targets [T], a ~2% keep mask [T, V] and cotangents [T] x 2."""
    key_logits, key_targets, key_mask, key_cot = jax.random.split(jax.random.key(seed), 4)
    # Logits like a language model's: a heavy tail of unlikely tokens, a few likely ones.
    logits32 = 4.0 * jax.random.normal(key_logits, (num_tokens, num_vocab), jnp.float32)
    targets = jax.random.randint(key_targets, (num_tokens,), 0, num_vocab)
    keep_mask = jax.random.uniform(key_mask, (num_tokens, num_vocab)) < 0.02
    cot_lp, cot_h = jax.random.normal(key_cot, (2, num_tokens), jnp.float32)
    return logits32, targets, keep_mask, cot_lp, cot_h


def _timed(fn, *args, warm=False, **kwargs):
    """Median wall time in ms of TIMING_REPEATS calls (one more first unless already `warm`)."""
    repeats = TIMING_REPEATS
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
    parser.add_argument("--tokens", type=int, default=8192 if on_gpu else 128)
    parser.add_argument("--vocab", type=int, default=151_936 if on_gpu else 32_000)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)
    num_tokens, num_vocab, tau = args.tokens, args.vocab, args.temperature

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; T = {num_tokens}, "
          f"V = {num_vocab}, temperature = {tau}"
          + ("" if on_gpu else " (scaled down on CPU; Pallas runs in interpret mode)"),
          flush=True)
    start = time.perf_counter()
    logits32, targets, keep_mask, cot_lp, cot_h = make_inputs(num_tokens, num_vocab)

    rows = []
    steps = [(dtype, mask, impl) for dtype in (jnp.float32, jnp.bfloat16)
             for mask in (None, keep_mask) for impl in ("reference", "pallas", "xla")]
    for step, (dtype, mask, impl) in enumerate(steps, 1):
        dtype_name, masked = jnp.dtype(dtype).name, "yes" if mask is not None else "no"
        _progress(f"[demo {step}/{len(steps)}] {dtype_name}, mask {masked}, {impl}: "
                  + ("float64 reference" if impl == "reference" else "errors and timings"),
                  end="")
        step_start = time.perf_counter()
        logits = logits32.astype(dtype)
        if impl == "reference":
            ref_grad, (ref_lp, ref_h) = forward_backward(
                logits.astype(jnp.float64), targets, mask, cot_lp, cot_h,
                implementation="reference", temperature=tau)
            jax.block_until_ready(ref_grad)
        else:
            options = dict(implementation=impl, temperature=tau)
            grad, (log_prob, entropy) = forward_backward(logits, targets, mask, cot_lp, cot_h,
                                                         **options)
            err_lp, err_h, err_g = map(float, _errors(log_prob, entropy, grad,
                                                      ref_lp, ref_h, ref_grad))
            del grad, log_prob, entropy
            fwd_ms = _timed(forward, logits, targets, mask, **options)
            fwd_bwd_ms = _timed(forward_backward, logits, targets, mask, cot_lp, cot_h,
                                warm=True, **options)
            rows.append((dtype_name, masked, impl, err_lp, err_h, err_g, fwd_ms, fwd_bwd_ms))
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
          f"of {TIMING_REPEATS} jitted calls"
          + ("." if on_gpu else " (CPU; interpret-mode Pallas is slow by design)."))


if __name__ == "__main__":
    main()
