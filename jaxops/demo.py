"""Demo: the op on synthetic logits vs the float64 reference, with errors and timings.

    python -m jaxops.demo [--tokens T] [--vocab V]

Sizes default to a realistic RL batch on GPU (T = 8192, V = 151,936) and are
scaled down on CPU, where the Pallas kernels run in interpret mode.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np


def _timed(fn, *args, repeats=5):
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main(argv=None):
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    import jaxops

    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192 if on_gpu else 128)
    parser.add_argument("--vocab", type=int, default=151_936 if on_gpu else 32_000)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)
    num_tokens, num_vocab = args.tokens, args.vocab

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; T = {num_tokens}, "
          f"V = {num_vocab}, temperature = {args.temperature}"
          + ("" if on_gpu else " (scaled down on CPU; Pallas runs in interpret mode)"))
    key_logits, key_targets, key_mask, key_cot = jax.random.split(jax.random.key(0), 4)
    # Logits like a language model's: a heavy tail of unlikely tokens, a few likely ones.
    logits32 = 4.0 * jax.random.normal(key_logits, (num_tokens, num_vocab), jnp.float32)
    targets = jax.random.randint(key_targets, (num_tokens,), 0, num_vocab)
    keep_mask = jax.random.uniform(key_mask, (num_tokens, num_vocab)) < 0.02
    cot_lp, cot_h = jax.random.normal(key_cot, (2, num_tokens), jnp.float32)

    def loss(logits, implementation, mask):
        log_prob, entropy = jaxops.logprob_entropy(
            logits, targets, keep_mask=mask, temperature=args.temperature,
            implementation=implementation)
        return (jnp.sum(log_prob * cot_lp.astype(log_prob.dtype))
                + jnp.sum(entropy * cot_h.astype(entropy.dtype))), (log_prob, entropy)

    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        logits = logits32.astype(dtype)
        for mask in (None, keep_mask):
            reference = jax.jit(jax.grad(lambda x, m=mask: loss(x, "reference", m), has_aux=True))
            ref_grad, (ref_lp, ref_h) = reference(logits.astype(jnp.float64))
            for impl in ("pallas", "xla"):
                fwd = jax.jit(lambda x, i=impl, m=mask: loss(x, i, m)[1])
                fwd_bwd = jax.jit(jax.grad(lambda x, i=impl, m=mask: loss(x, i, m), has_aux=True))
                grad, (log_prob, entropy) = fwd_bwd(logits)
                err_lp = float(jnp.max(jnp.abs(log_prob - ref_lp)))
                err_h = float(jnp.max(jnp.abs(entropy - ref_h)))
                err_g = float(jnp.linalg.norm(grad.astype(jnp.float64) - ref_grad)
                              / jnp.linalg.norm(ref_grad))
                rows.append((jnp.dtype(dtype).name, "yes" if mask is not None else "no", impl,
                             err_lp, err_h, err_g, _timed(fwd, logits), _timed(fwd_bwd, logits)))

    header = ("dtype", "mask", "impl", "|lp err|max", "|H err|max", "grad rel err",
              "fwd ms", "fwd+bwd ms")
    print("\n" + " | ".join(f"{h:>12s}" for h in header))
    print("-" * (15 * len(header)))
    for row in rows:
        print(" | ".join(f"{v:>12s}" if isinstance(v, str) else f"{v:12.3g}" for v in row))
    print("\nErrors are against the float64 reference on the same input values; gradients in "
          "the logits' dtype\n(bf16 gradients carry one bf16 rounding, ~4e-3). Timings: median "
          "of 5 jitted calls" + ("." if on_gpu else " (CPU; interpret-mode Pallas is slow by design)."))


if __name__ == "__main__":
    main()
