"""Where the chunked fused head's time goes at small T (issue 13): one H200 run.

    python -m benchmarks.linear_chunks --out benchmarks/results/h200_linear_chunks.json
    python -m benchmarks.linear_chunks --tiny            # CPU smoke run (tiny shapes)

At T = 4096, H = 4096, V = 151,936 bf16 the chunked op is 1.24x its four GEMMs
forward+backward and ~1.3x forward. Two candidates for the forward's excess, timed here
in one process (ms, median of 5 calls after a compile call):
  * per-chunk costs (a launch, a merge, a scan step): jaxops.linear_logprob_entropy
    forward and forward+backward at several chunk widths (wider = fewer chunks, more
    memory);
  * the chunks' fp32 logits: the forward GEMM alone with bf16 output (what the floor
    times) and with fp32 output (what the chunked forward writes and reads back).

`--mask bool|uint8` adds a keep mask; `--masked-fused on|off|both` times the call with
the fused kernels taking the mask (`linear_mosaic.MASKED`, off by default until timed
here) or with the chunked path.

`--pieces` times one chunk of the backward instead, per chunk width C: its whole body
(`linear.chunked_backward` on a weight of C rows: recompute, d logits kernel, both
GEMMs) and each GEMM alone at the chunk's shapes, with `x chunks` = the time times
V / C, to set against the full-size GEMMs (how much of the backward's excess is the
smaller GEMMs and how much the rest of the body).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json

from benchmarks import harness


def _time_ms(fn, *args):
    """Median over 3 repetitions of the mean of 5 back-to-back calls, after one warm-up
    (compile) call. (Until session 17: the median of 5 single calls, each waited for,
    which adds the host's dispatch and sync latency to every time.)"""
    return harness.time_calls(fn, (args,), reps=3, calls=5,
                              sync=harness.block_jax).seconds * 1e3


def _temp_gib(fn, *args):
    """XLA's temporary bytes (GiB) for the compiled `fn` (jitted) on these arguments."""
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**30


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--pieces", action="store_true", help="time one backward chunk's parts")
    parser.add_argument("--shape", default="4096,4096", help="T,H (V = 151,936)")
    parser.add_argument("--chunks", default="2048,4096,8192,16384,32768")
    parser.add_argument("--fused-backward", default="on", choices=("on", "off", "both"),
                        help="the backward's d logits from linear_mosaic.backward_logits "
                        "(where it applies) or from the chunk's GEMM + statistics kernel")
    parser.add_argument("--mask", default="none", choices=("none", "bool", "uint8"),
                        help="a random keep mask [T, V] (30%% kept, the target kept)")
    parser.add_argument("--masked-fused", default="off", choices=("on", "off", "both"),
                        help="with --mask: the fused kernels with the mask "
                        "(linear_mosaic.MASKED) or the chunked path")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import jaxops

    if args.tiny:
        T, H, V, chunks, dtype = 64, 32, 1000, (128, 256, 1000), jnp.float32
    else:
        (T, H), V, dtype = (int(v) for v in args.shape.split(",")), 151_936, jnp.bfloat16
        chunks = tuple(int(c) for c in args.chunks.split(","))
    k = jax.random.split(jax.random.key(0), 4)
    h = (jax.random.normal(k[0], (T, H), jnp.float32) * 0.5).astype(dtype)
    w = (jax.random.normal(k[1], (V, H), jnp.float32) / 64).astype(dtype)
    y = jax.random.randint(k[2], (T,), 0, V)
    g = jax.random.normal(k[3], (T,), jnp.float32)
    mask = None
    if args.mask != "none":
        mask = (jax.random.uniform(jax.random.key(9), (T, V)) < 0.3).at[
            jnp.arange(T), y].set(True).astype(jnp.bool_ if args.mask == "bool" else jnp.uint8)
    results = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
               "T": T, "H": H, "V": V, "dtype": jnp.dtype(dtype).name, "mask": args.mask,
               "rows": []}

    def record(name, **row):
        row = {"name": name, **row}
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    if args.pieces:
        _pieces(record, h, w, y, g, chunks)
        return
    for out_dtype in (dtype, jnp.float32):
        gemm = jax.jit(lambda h, w, o=out_dtype: jnp.dot(h, w.T, preferred_element_type=o))
        record("forward GEMM", out_dtype=jnp.dtype(out_dtype).name, ms=_time_ms(gemm, h, w))
    from jaxops import linear, linear_mosaic

    fits, masked_fused = linear.fused_backward_fits, linear_mosaic.MASKED
    modes = ("on", "off") if args.fused_backward == "both" else (args.fused_backward,)
    mask_modes = (("on", "off") if args.masked_fused == "both"
                  else (args.masked_fused,)) if mask is not None else (None,)
    for chunk in chunks:
        fwd = jax.jit(lambda h, w, y, m, c=chunk: jaxops.linear_logprob_entropy(
            h, w, y, keep_mask=m, chunk_size=c))

        def fb(h, w, y, m, g, c=chunk):
            _, vjp = jax.vjp(lambda h, w: jaxops.linear_logprob_entropy(
                h, w, y, keep_mask=m, chunk_size=c), h, w)
            return vjp((g, g))

        for mode in modes:
            for mask_mode in mask_modes:
                linear.fused_backward_fits = fits if mode == "on" else (lambda *a: False)
                linear_mosaic.MASKED = mask_mode == "on"
                labels = dict(chunk=chunk, fused_backward=mode)
                if mask_mode is not None:
                    labels["masked_fused"] = mask_mode
                try:
                    fb_jit = jax.jit(fb)
                    record("linear_logprob_entropy", **labels,
                           fwd_ms=_time_ms(fwd, h, w, y, mask),
                           fb_ms=_time_ms(fb_jit, h, w, y, mask, g),
                           fb_temp_gib=_temp_gib(fb_jit, h, w, y, mask, g),
                           logits_gib=T * V * 2 / 2**30)
                except Exception as exc:  # noqa: BLE001 -- an OOM at a wide chunk: go on
                    record("linear_logprob_entropy", **labels, error=str(exc)[:300])
                finally:
                    linear.fused_backward_fits = fits
                    linear_mosaic.MASKED = masked_fused


def _chunk_d_logits(h, w_c, y, max_logit, coefs, impl, config):
    """The chunked backward's d logits of one chunk: the GEMM, then the kernel."""
    from jaxops import implementations, linear

    return implementations.kernels(impl).backward_logits(
        linear._logits(h, w_c), y, None, max_logit, None, coefs, inv_tau=1.0, config=config,
        out_dtype=h.dtype)


def _pieces(record, h, w, y, g, chunks):
    """One backward chunk's body and its GEMMs alone, per chunk width (module docstring)."""
    import jax
    import jax.numpy as jnp

    from jaxops import implementations, linear
    from jaxops.contract import BackwardCoefs

    T, H = h.shape
    V = w.shape[0]
    f32 = jnp.float32

    def dot(a, b, dims, out):
        return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=out)

    for name, fn, args in (
            ("full GEMM logits", lambda h, w: dot(h, w, ((1,), (1,)), h.dtype), (h, w)),
            ("full GEMM d hidden", lambda d, w: dot(d, w, ((1,), (0,)), f32),
             (jnp.ones((T, V), h.dtype), w))):
        record(name, ms=_time_ms(jax.jit(fn), *args))
    max_logit = jnp.full((T,), 3.0, f32)
    coefs = BackwardCoefs(coef_sum=g, coef_shifted=g, coef_target=g, coef_masked=None)
    for chunk in chunks:
        w_c = w[:chunk]
        impl, config = implementations.for_call(
            *implementations.resolve(None), num_vocab=chunk, itemsize=4, mask_dtype=None,
            num_tokens=T)
        d_logits = (jax.random.normal(jax.random.key(5), (T, chunk), f32) / 64).astype(h.dtype)
        acc = jnp.zeros((T, H), f32)
        body = jax.jit(lambda h, w_c, y, c=chunk, i=impl, k=config: linear.chunked_backward(
            h, w_c, y, None, max_logit, None, coefs, inv_tau=1.0, implementation=i,
            config=k, chunk=c, want_d_weight=True))
        parts = {
            "body": _time_ms(body, h, w_c, y % chunk),
            "logits": _time_ms(jax.jit(lambda h, w_c: dot(h, w_c, ((1,), (1,)), f32)), h, w_c),
            "d_hidden": _time_ms(jax.jit(lambda a, d, w_c: a + dot(d, w_c, ((1,), (0,)), f32)),
                                 acc, d_logits, w_c),
            "d_weight": _time_ms(jax.jit(lambda d, h: dot(d, h, ((0,), (0,)), f32).astype(
                h.dtype)), d_logits, h),
            "d_weight_bf16_out": _time_ms(jax.jit(lambda d, h: dot(d, h, ((0,), (0,)),
                                                                 h.dtype)), d_logits, h)}
        if jax.default_backend() == "gpu":
            from jaxops import linear_mosaic

            want = jax.jit(lambda h, w_c, y, i=impl, k=config: _chunk_d_logits(
                h, w_c, y, max_logit, coefs, i, k))(h, w_c, y % chunk)
            for chunk_v in (2048, 1024, 512):
                fused = jax.jit(lambda h, w_c, y, c=chunk_v: linear_mosaic.backward_logits(
                    h, w_c, y, max_logit, coefs, inv_tau=1.0, chunk_v=c))
                try:
                    got = fused(h, w_c, y % chunk)
                    err = float(jnp.max(jnp.abs(got.astype(f32) - want.astype(f32)))
                                / jnp.max(jnp.abs(want.astype(f32))))
                    parts[f"fused_d_logits_{chunk_v}"] = _time_ms(fused, h, w_c, y % chunk)
                    record("fused d logits", chunk=chunk, chunk_v=chunk_v, max_error=err)
                except Exception as exc:  # noqa: BLE001 -- a failed variant is a result
                    record("fused d logits", chunk=chunk, chunk_v=chunk_v,
                           error=str(exc)[:300])
            parts["logits_and_d_logits"] = _time_ms(jax.jit(
                lambda h, w_c, y, i=impl, k=config: _chunk_d_logits(
                    h, w_c, y, max_logit, coefs, i, k)), h, w_c, y % chunk)
        record("backward chunk", chunk=chunk, implementation=impl, **{
            f"{k}_ms": v for k, v in parts.items()}, **{
            f"{k}_x_chunks_ms": v * V / chunk for k, v in parts.items()})


if __name__ == "__main__":
    main()
