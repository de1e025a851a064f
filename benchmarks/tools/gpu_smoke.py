"""Quick GPU check: both Pallas backends vs the float64 reference, and first timings.

    python -m benchmarks.tools.gpu_smoke [--out DIR] [--configs "block_v,num_warps,num_stages;..."]
"""
if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import argparse, os, traceback  # noqa: E401
import numpy as np
import jax, jax.numpy as jnp  # noqa: E401
import jaxops
from benchmarks import harness

def check(T, V, dtype, masked, tau, with_entropy=True, entropy_grad=True, impl="pallas_triton", config=None):
    rng = np.random.default_rng(T * 7 + V)
    x = jnp.asarray(rng.normal(size=(T, V)) * 4, dtype)
    y = jnp.asarray(rng.integers(0, V, T), jnp.int32)
    m = jnp.asarray(rng.random((T, V)) < 0.05) if masked else None
    gl = jnp.asarray(rng.normal(size=T)); gh = jnp.asarray(rng.normal(size=T))
    def loss(x, y, m, gl, gh, impl):  # every array an argument: nothing baked into the HLO
        lp, h = jaxops.logprob_entropy(x, y, keep_mask=m, temperature=tau, implementation=impl,
                                       with_entropy=with_entropy, entropy_grad=entropy_grad, pallas_config=config)
        out = jnp.sum(lp * gl.astype(lp.dtype))
        if h is not None: out += jnp.sum(h * gh.astype(h.dtype))
        return out, (lp, h)
    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnames="impl")
    (_, (lp, h)), g = grad(x, y, m, gl, gh, impl=impl)
    (_, (lpr, hr)), gr = grad(x.astype(jnp.float64), y, m, gl, gh, impl="reference")
    e_lp = float(jnp.max(jnp.abs(lp - lpr)))
    e_h = float(jnp.max(jnp.abs(h - hr))) if h is not None else 0.0
    e_g = float(jnp.linalg.norm(g.astype(jnp.float64) - gr) / jnp.linalg.norm(gr))
    return e_lp, e_h, e_g, g.dtype

def bench(fn, args_list, iters=20):
    """Median ms per call of 5 loops of `iters` calls rotating over `args_list`."""
    return harness.time_calls(fn, args_list, reps=5, calls=iters, sync=jax.block_until_ready).seconds * 1e3

def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--out", default=None); ap.add_argument("--configs", default="")
    a = ap.parse_args()
    jax.config.update("jax_enable_x64", True)  # the float64 reference of check()
    print(jax.devices(), jax.__version__, flush=True)
    results = {"checks": [], "timings": []}
    for (T, V, dt, masked, tau) in [(64, 1000, jnp.float32, False, 1.0), (64, 1000, jnp.bfloat16, True, 0.7),
                                    (33, 151936 // 8, jnp.float16, True, 1.3), (17, 151936, jnp.float32, True, 1.0),
                                    (17, 151936, jnp.bfloat16, False, 0.9), (5, 7, jnp.float32, True, 1.0)]:
        for impl in ("pallas_triton", "pallas_mosaic"):  # both Pallas backends (issue 14)
            try:
                r = check(T, V, dt, masked, tau, impl=impl)
                print("check", impl, T, V, dt.__name__, masked, tau, r, flush=True)
                results["checks"].append([impl, T, V, dt.__name__, masked, tau, r[:3]])
            except Exception:
                traceback.print_exc()
                print("FAILED check", impl, T, V, dt.__name__, masked, flush=True)
                results["checks"].append([impl, T, V, dt.__name__, masked, tau, "FAILED"])
    # copy bandwidth
    big = jnp.ones((8192, 151936), jnp.float32) * 1.5
    copy = jax.jit(lambda a: a * 1.0000001)
    t = bench(copy, [(big,)])
    bw = 2 * big.size * 4 / (t * 1e-3) / 1e12
    print(f"copy bandwidth {bw:.2f} TB/s", flush=True); results["copy_tbps"] = bw
    del big
    T, V = 8192, 151936
    rng = np.random.default_rng(1)
    cfgs = [None] + [jaxops.PallasConfig(*map(int, c.split(","))) for c in a.configs.split(";") if c]
    for dt in [jnp.bfloat16, jnp.float32]:
        xs = [jax.random.normal(jax.random.key(i), (T, V), dt) * 3 for i in range(2)]
        y = jnp.asarray(rng.integers(0, V, T), jnp.int32)
        nbytes, fb_bytes = harness.roofline_bytes(dt.__name__, T, V, False)
        roof_f, roof_fb = harness.roofline_ms(nbytes, bw * 1e12), harness.roofline_ms(fb_bytes, bw * 1e12)
        for impl, cfg in [("xla", None)] + [("pallas_triton", c) for c in cfgs]:
            for ent in [True, False]:
                try:
                    fwd = jax.jit(lambda x, y: jaxops.logprob_entropy(x, y, implementation=impl, with_entropy=ent, pallas_config=cfg))
                    fb = jax.jit(jax.grad(lambda x, y: sum(jnp.sum(o) for o in jaxops.logprob_entropy(x, y, implementation=impl, with_entropy=ent, pallas_config=cfg) if o is not None)))
                    tf = bench(fwd, [(x, y) for x in xs]); tb = bench(fb, [(x, y) for x in xs])
                    print(f"{dt.__name__:9s} {impl:6s} {str(cfg):60s} ent={ent:d} fwd {tf:.3f} ms ({tf/roof_f:.2f}x roof) fwd+bwd {tb:.3f} ms ({tb/roof_fb:.2f}x roof)", flush=True)
                    results["timings"].append(dict(dtype=dt.__name__, impl=impl, cfg=str(cfg), ent=ent, fwd=tf, fb=tb, roof_f=roof_f))
                except Exception:
                    traceback.print_exc(); print("FAILED timing", dt.__name__, impl, cfg, flush=True)
    if a.out:
        harness.write_json(os.path.join(a.out, "smoke.json"), results)

if __name__ == "__main__":
    main()
