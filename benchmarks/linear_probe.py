"""First GPU numbers for the chunked fused head (issue 13 step 1): fwd+bwd of
linear_logprob_entropy vs unfused (JAX dot + the op) vs the GEMMs alone, bf16.

    python -m benchmarks.linear_probe   # NOTES "The fused LM head, chunked"; LP_CASES=4096x4096,16384x4096 (T x H)
"""
import time, json, os
import jax, jax.numpy as jnp
from jax import lax
import jaxops
OUT = os.environ.get("OUT", "/tmp")
V = 151936
def timeit(f, *a, n=5):
    jax.block_until_ready(f(*a))
    t0 = time.perf_counter()
    for _ in range(n): out = f(*a)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n * 1e3
res = {}
for T, H in [tuple(int(v) for v in c.split('x')) for c in os.environ.get('LP_CASES', '4096x4096,16384x4096').split(',')]:
    k = jax.random.split(jax.random.key(0), 4)
    h = (jax.random.normal(k[0], (T, H), jnp.float32) * 0.5).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (V, H), jnp.float32) / 64).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (T,), 0, V)
    g = jax.random.normal(k[3], (T,), jnp.float32)
    def fused(h, w, y, g):
        (lp, e), vjp = jax.vjp(lambda h, w: jaxops.linear_logprob_entropy(h, w, y), h, w)
        return vjp((g, g))
    def fused_fwd(h, w, y):
        return jaxops.linear_logprob_entropy(h, w, y)
    def unfused(h, w, y, g):
        (lp, e), vjp = jax.vjp(lambda h, w: jaxops.logprob_entropy(jnp.dot(h, w.T), y), h, w)
        return vjp((g, g))
    def gemms(h, w):  # forward, recompute, d hidden, d weight: the fused op's GEMM floor
        l = jnp.dot(h, w.T)
        l2 = jnp.dot(lax.optimization_barrier(h), w.T)
        dh = jnp.dot(l2, w, preferred_element_type=jnp.float32)
        dw = jnp.dot(l.T, h, preferred_element_type=jnp.float32)
        return dh, dw
    def gemm_fwd(h, w):
        return jnp.dot(h, w.T)
    r = res[f"T{T}_H{H}"] = {}
    for name, f, a, flops in (("gemm_floor_4", gemms, (h, w), 8), ("gemm_fwd", gemm_fwd, (h, w), 2),
                              ("fused_chunked", fused, (h, w, y, g), 8),
                              ("fused_fwd", fused_fwd, (h, w, y), 2),
                              ("unfused_jax", unfused, (h, w, y, g), 8)):
        try:
            jf = jax.jit(f)
            comp = jf.lower(*a).compile()
            mem = comp.memory_analysis()
            ms = timeit(comp, *a)
            r[name] = dict(ms=round(ms, 3), tflops=round(flops * T * H * V / ms / 1e9, 1),
                           temp_gib=round(getattr(mem, "temp_size_in_bytes", -1) / 2**30, 3))
        except Exception as e:
            r[name] = dict(error=repr(e)[:400])
        print(T, H, name, r[name], flush=True)
    if T == 4096:
        dh1, dw1 = jax.jit(fused)(h, w, y, g); dh2, dw2 = jax.jit(unfused)(h, w, y, g)
        rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
        r["rel_diff_dh_vs_unfused_bf16"] = rel(dh1, dh2); r["rel_diff_dw_vs_unfused_bf16"] = rel(dw1, dw2)
        print(r, flush=True)
    json.dump(res, open(os.path.join(OUT, "linear_probe.json"), "w"), indent=1)
