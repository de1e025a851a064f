"""Mosaic GPU kernel sweep (issue 14): the statistics and gradient kernels alone.

    python -m benchmarks.tools.mosaic_tune [--out FILE.json] [--quick] [--api | --small]

Times `mosaic_kernels.forward_stats` and `backward_logits` jitted on their own, with the
keep mask handed over as uint8 (so no bool -> uint8 pass: the kernel's own cost), for
`MosaicConfig` variants: masked bf16/fp32 at T = 8192, V = 151,936 over pipeline depth
and tile width (shared memory per CTA decides how many CTAs share an SM), and unmasked
bf16 at T = 1024 over the chunk width (CTAs in the grid). Each variant's masked
log-sum-exp is checked against the XLA implementation first. `--api` times instead the
public op (`jaxops.logprob_entropy`, implementation "pallas_mosaic", default config) at
T = 8192, V = 151,936, forward and forward+backward, with no mask, a bool mask and a
uint8 mask (a bool mask costs the Mosaic kernels a bool -> uint8 pass per kernel).
`--small` sweeps the chunk and tile widths where the grid is a few waves of CTAs only
(bf16 with entropy, no mask: T = 1024 at V = 151,936, and T = 8192 at V_loc = 18,992).
Times: median of 5 rounds of 20 back-to-back calls over 2 input sets
(harness.time_calls); x roof: harness.roofline_bytes / the copy bandwidth measured in
the same run.
"""
if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import argparse, dataclasses, functools, json, time  # noqa: E401

import numpy as np
import jax
import jax.numpy as jnp

from benchmarks import harness
from jaxops.backends import xla
from jaxops.backends.mosaic import kernels as mosaic_kernels
from jaxops.backends.mosaic.config import MosaicConfig
from jaxops.contract import BackwardCoefs

V = 151936


def _inputs(num_tokens, dtype, masked, seed, num_vocab=None):
    num_vocab = num_vocab or V
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    logits = (jax.random.normal(k1, (num_tokens, num_vocab), jnp.float32) * 3).astype(dtype)
    targets = jax.random.randint(k2, (num_tokens,), 0, num_vocab, jnp.int32)
    # A top-p-like keep set: the logits above a per-row threshold (the max is kept).
    mask = ((logits.astype(jnp.float32) > 6.0).astype(jnp.uint8) if masked else None)
    return logits, targets, mask


def _copy_bandwidth():
    x = jnp.ones((2**30,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    s = harness.time_calls(copy, [(x,)], reps=5, calls=10, sync=jax.block_until_ready).seconds
    return 2 * x.nbytes / s


def run_case(num_tokens, dtype, masked, config, bandwidth, num_vocab=None):
    num_vocab = num_vocab or V
    sets = [_inputs(num_tokens, dtype, masked, s, num_vocab) for s in (0, 1)]
    fwd = jax.jit(lambda x, y, m: mosaic_kernels.forward_stats(
        x, y, m, inv_tau=1.0, with_entropy=True, config=config))
    stats = fwd(*sets[0])
    want = xla.forward_stats(sets[0][0], sets[0][1],
                             None if sets[0][2] is None else sets[0][2] != 0,
                             inv_tau=1.0, with_entropy=True)
    lse = lambda s, m: np.asarray(m) + np.log(np.asarray(s))  # noqa: E731
    err = float(np.max(np.abs(lse(stats.sum_exp, stats.max_logit)
                              - lse(want.sum_exp, want.max_logit))))
    if masked:
        err = max(err, float(np.nanmax(np.abs(
            lse(stats.masked_sum_exp, stats.masked_max)
            - lse(want.masked_sum_exp, want.masked_max)))))
    coef = lambda c: jnp.full((num_tokens,), c, jnp.float32)  # noqa: E731
    coefs = BackwardCoefs(coef(-0.5), coef(0.1), coef(1.0), coef(0.7) if masked else None)
    bwd = jax.jit(lambda x, y, m, mx, mm: mosaic_kernels.backward_logits(
        x, y, m, mx, mm, coefs, inv_tau=1.0, config=config))
    bsets = [(x, y, m, stats.max_logit, stats.masked_max) for x, y, m in sets]
    t_f = harness.time_calls(fwd, sets, reps=5, calls=20, sync=jax.block_until_ready).seconds
    t_b = harness.time_calls(bwd, bsets, reps=5, calls=20, sync=jax.block_until_ready).seconds
    fwd_bytes, fb_bytes = harness.roofline_bytes(jnp.dtype(dtype).name, num_tokens,
                                                 num_vocab, masked)
    bwd_bytes = fb_bytes - fwd_bytes
    return dict(T=num_tokens, V=num_vocab, dtype=jnp.dtype(dtype).name, masked=masked,
                config={k: v for k, v in dataclasses.asdict(config).items() if v is not None},
                fwd_ms=t_f * 1e3, bwd_ms=t_b * 1e3,
                fwd_x_roof=t_f * bandwidth / fwd_bytes, bwd_x_roof=t_b * bandwidth / bwd_bytes,
                fb_x_roof=(t_f + t_b) * bandwidth / (fwd_bytes + bwd_bytes), max_lse_err=err)


def variants(quick):
    masked = [dict(), dict(num_stages=2), dict(num_stages=3), dict(num_stages=4),
              dict(block_v=64, num_stages=4), dict(block_v=64, num_stages=6),
              dict(block_v=256, num_stages=2)]
    if quick:
        masked = masked[:4]
    cases = [(8192, jnp.bfloat16, True, MosaicConfig(**c)) for c in masked]
    cases += [(8192, jnp.float32, True, MosaicConfig(**c)) for c in masked[:4]]
    cases += [(8192, jnp.bfloat16, False, MosaicConfig())]
    cases += [(1024, jnp.bfloat16, False, MosaicConfig(**c)) for c in
              (dict(), dict(chunk_v=2048), dict(chunk_v=1024), dict(chunk_v=2048, num_stages=4))]
    return cases


def small_variants():
    """bf16 with entropy, no mask, where the grid is only a few waves of CTAs: pipeline
    depth (shared memory per CTA, hence CTAs per SM) and chunk width (CTAs per row block,
    hence waves); one config applies to both kernels (read fwd and bwd separately)."""
    configs = [dict(), dict(num_stages=2), dict(num_stages=3), dict(num_stages=4),
               dict(chunk_v=2048), dict(chunk_v=2048, num_stages=3),
               dict(chunk_v=2048, num_stages=4)]
    return [(num_tokens, jnp.bfloat16, False, MosaicConfig(**c), num_vocab)
            for num_tokens, num_vocab in ((1024, V), (8192, 18992), (8192, V))
            for c in configs]


def api_case(dtype, with_entropy, mask_dtype, bandwidth, num_tokens=8192):
    import jaxops

    sets = []
    for seed in (0, 1):
        logits, targets, mask = _inputs(num_tokens, dtype, mask_dtype is not None, seed)
        sets.append((logits, targets, None if mask is None else mask.astype(mask_dtype)))

    def op(x, y, m):
        return jaxops.logprob_entropy(x, y, keep_mask=m, with_entropy=with_entropy,
                                      implementation="pallas_mosaic")

    def loss(x, y, m):
        lp, h = op(x, y, m)
        return jnp.sum(lp) + (jnp.sum(h) if with_entropy else 0.0)

    fwd, fb = jax.jit(op), jax.jit(jax.grad(loss))
    t_f = harness.time_calls(fwd, sets, reps=5, calls=20, sync=jax.block_until_ready).seconds
    t_b = harness.time_calls(fb, sets, reps=5, calls=20, sync=jax.block_until_ready).seconds
    fwd_bytes, fb_bytes = harness.roofline_bytes(jnp.dtype(dtype).name, num_tokens, V,
                                                 mask_dtype is not None)
    return dict(api=True, T=num_tokens, dtype=jnp.dtype(dtype).name, entropy=with_entropy,
                mask=None if mask_dtype is None else jnp.dtype(mask_dtype).name,
                fwd_ms=t_f * 1e3, fb_ms=t_b * 1e3, fwd_x_roof=t_f * bandwidth / fwd_bytes,
                fb_x_roof=t_b * bandwidth / fb_bytes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--api", action="store_true")
    parser.add_argument("--small", action="store_true",
                        help="the small-grid sweep (T = 1024; V_loc = 18,992) instead")
    args = parser.parse_args()
    start = time.perf_counter()
    bandwidth = _copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    if args.api:
        cases = [functools.partial(api_case, dtype, entropy, mask)
                 for dtype in (jnp.bfloat16, jnp.float32) for entropy in (True, False)
                 for mask in (jnp.uint8, jnp.bool_, None)]
    else:
        chosen = small_variants() if args.small else variants(args.quick)
        cases = [functools.partial(run_case, *case[:4], num_vocab=(case[4:] or (None,))[0])
                 for case in chosen]
    for case in cases:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            print("budget spent: stopping", flush=True)
            break
        try:
            row = case(bandwidth=bandwidth)
        except Exception as e:  # a variant that does not compile is a result too
            row = dict(case=str(case.args)[:200], error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(bandwidth_Bps=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
