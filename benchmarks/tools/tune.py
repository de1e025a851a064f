"""Kernel tuning sweep on one GPU: Pallas config variants at T = 8192, V = 151,936.

    python -m benchmarks.tools.tune --configs "block_v=2048,num_warps=4;block_v=1024,approx_exp2=0" [--out DIR]

Each config is checked against the float64 reference on a small case first
(a variant that is fast but wrong is reported as such), then timed: forward and
forward+backward, fp32 and bf16, entropy on/off, with a dense keep mask.
Times are medians of 5 rounds of 20 back-to-back jitted calls over 2 input sets
(harness.time_calls); the roofline is harness.roofline_bytes / the copy bandwidth.
"""
if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import argparse, os, traceback  # noqa: E401

import numpy as np
import jax
import jax.numpy as jnp

import jaxops
from benchmarks import harness


def max_errors(cfg, num_tokens=33, num_vocab=151936 // 8 + 5, dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(num_tokens, num_vocab)) * 4, dtype)
    y = jnp.asarray(rng.integers(0, num_vocab, num_tokens), jnp.int32)
    mask = jnp.asarray(rng.random((num_tokens, num_vocab)) < 0.05)
    cot = jnp.asarray(rng.normal(size=(2, num_tokens)), jnp.float32)

    def loss(x, y, mask, cot, impl):  # every array an argument: nothing baked into the HLO
        lp, h = jaxops.logprob_entropy(x, y, keep_mask=mask, temperature=0.8, implementation=impl,
                                       pallas_config=cfg if impl == "pallas_triton" else None)
        return jnp.sum(lp * cot[0].astype(lp.dtype)) + jnp.sum(h * cot[1].astype(h.dtype)), (lp, h)

    grad = jax.jit(jax.grad(loss, has_aux=True), static_argnames="impl")
    g, (lp, h) = grad(x, y, mask, cot, impl="pallas_triton")
    gr, (lpr, hr) = grad(x.astype(jnp.float64), y, mask, cot, impl="reference")
    return (float(jnp.max(jnp.abs(lp - lpr))), float(jnp.max(jnp.abs(h - hr))),
            float(jnp.linalg.norm(g.astype(jnp.float64) - gr) / jnp.linalg.norm(gr)))


def extreme_errors(cfg):
    """Masked log-prob where kept logits sit ~1e4 below an unkept max (the exact-pass path)."""
    rng = np.random.default_rng(1)
    num_tokens, num_vocab = 6, 20000
    x = rng.normal(size=(num_tokens, num_vocab)) * 2
    x[:, 5] = 1e4
    mask = rng.random((num_tokens, num_vocab)) < 0.05
    mask[:, 5] = False
    mask[1] = False
    y = rng.integers(10, num_vocab, num_tokens)
    y[3] = 5
    x[4] = -np.inf
    x[4, :3] = 1.0
    mask[4, :3] = True
    y[4] = 1
    x, mask, y = jnp.asarray(x, jnp.float32), jnp.asarray(mask), jnp.asarray(y)

    def loss(x, y, mask, impl):
        lp, h = jaxops.logprob_entropy(x, y, keep_mask=mask, implementation=impl,
                                       pallas_config=cfg if impl == "pallas_triton" else None)
        return jnp.sum(lp * jnp.arange(1.0, num_tokens + 1, dtype=lp.dtype)), (lp, h)

    grad = jax.jit(jax.grad(loss, has_aux=True), static_argnames="impl")
    g, (lp, h) = grad(x, y, mask, impl="pallas")
    gr, (lpr, hr) = grad(x.astype(jnp.float64), y, mask, impl="reference")
    return (float(jnp.max(jnp.abs(lp - lpr))), float(jnp.max(jnp.abs(h - hr))),
            float(jnp.linalg.norm(g.astype(jnp.float64) - gr) / jnp.linalg.norm(gr)))


def check(cfg):
    """Print the config's errors against the float64 reference; False if it fails to run."""
    try:
        print("check", cfg, ["%.2e" % e for e in max_errors(cfg)],
              "extreme", ["%.2e" % e for e in extreme_errors(cfg)], flush=True)
        return True
    except Exception:
        traceback.print_exc()
        print("FAILED check", cfg, flush=True)
        return False


def timed(fn, inputs, iters=20, rounds=5):
    """Median ms per call of `rounds` loops of `iters` calls rotating over `inputs`."""
    return harness.time_calls(fn, inputs, reps=rounds, calls=iters,
                              sync=jax.block_until_ready).seconds * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="")
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--cases", default="ent,noent,mask,mask-noent")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the float64 check of each config (faster; for a first sweep)")
    parser.add_argument("--no-default", action="store_true",
                        help="do not time the default config first")
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)  # the float64 reference of check()
    configs = [] if args.no_default else [jaxops.PallasConfig()]
    configs += harness.parse_pallas_configs(args.configs)
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    rows = []
    big = jax.random.normal(jax.random.key(9), (8192, 151936), jnp.float32)
    t_copy = timed(jax.jit(lambda a: a + 1.0), [(big,)])
    bandwidth = 2 * big.size * 4 / (t_copy * 1e-3)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    del big
    T, V = 8192, 151936
    y = jax.random.randint(jax.random.key(1), (T,), 0, V)
    mask = jax.random.uniform(jax.random.key(2), (T, V)) < 0.05
    for cfg in configs:
        if args.no_check:
            print("unchecked", cfg, flush=True)
        elif not check(cfg):
            continue
        for dtype_name in args.dtypes.split(","):
            dtype = jnp.dtype(dtype_name)
            xs = [jax.random.normal(jax.random.key(i), (T, V), dtype) * 3 for i in range(2)]
            for case in args.cases.split(","):
                ent, m = "noent" not in case, (mask if "mask" in case else None)
                fwd_bytes, fb_bytes = harness.roofline_bytes(dtype_name, T, V, m is not None)
                # targets and mask are arguments: a captured [T, V] mask would be baked into
                # the program as a 1.2 GB constant (minutes of compile time)
                op = lambda x, y, m: jaxops.logprob_entropy(  # noqa: E731
                    x, y, keep_mask=m, with_entropy=ent, implementation="pallas_triton",
                    pallas_config=cfg)
                fwd = jax.jit(op)
                fwd_bwd = jax.jit(jax.grad(
                    lambda x, y, m: sum(jnp.sum(o) for o in op(x, y, m) if o is not None)))
                inputs = [(x, y, m) for x in xs]
                try:
                    tf, tb = timed(fwd, inputs), timed(fwd_bwd, inputs)
                except Exception:
                    traceback.print_exc()
                    print("FAILED", cfg, dtype_name, case, flush=True)
                    continue
                roof_f = harness.roofline_ms(fwd_bytes, bandwidth)
                roof_b = harness.roofline_ms(fb_bytes, bandwidth)
                row = dict(config=str(cfg), dtype=dtype_name, case=case, fwd_ms=tf, fwd_bwd_ms=tb,
                           fwd_roofline_ms=roof_f, fwd_bwd_roofline_ms=roof_b)
                rows.append(row)
                print(f"{dtype_name:8s} {case:6s} fwd {tf:.3f} ms ({tf / roof_f:.2f}x)  "
                      f"fwd+bwd {tb:.3f} ms ({tb / roof_b:.2f}x)  {cfg}", flush=True)
            del xs
        if args.out:
            harness.write_json(os.path.join(args.out, "tune.json"),
                               dict(bandwidth=bandwidth, rows=rows))


if __name__ == "__main__":
    main()
