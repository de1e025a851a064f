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
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json

from benchmarks import harness


def _time_ms(fn, *args):
    """Median of 5 single calls, each waited for, after one warm-up (compile) call."""
    return harness.time_calls(fn, (args,), reps=5, calls=1,
                              sync=harness.block_jax).seconds * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import jaxops

    if args.tiny:
        T, H, V, chunks, dtype = 64, 32, 1000, (128, 256, 1000), jnp.float32
    else:
        T, H, V, chunks, dtype = 4096, 4096, 151_936, (2048, 4096, 8192, 16384, 32768), \
            jnp.bfloat16
    k = jax.random.split(jax.random.key(0), 4)
    h = (jax.random.normal(k[0], (T, H), jnp.float32) * 0.5).astype(dtype)
    w = (jax.random.normal(k[1], (V, H), jnp.float32) / 64).astype(dtype)
    y = jax.random.randint(k[2], (T,), 0, V)
    g = jax.random.normal(k[3], (T,), jnp.float32)
    results = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
               "T": T, "H": H, "V": V, "dtype": jnp.dtype(dtype).name, "rows": []}

    def record(name, **row):
        row = {"name": name, **row}
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    for out_dtype in (dtype, jnp.float32):
        gemm = jax.jit(lambda h, w, o=out_dtype: jnp.dot(h, w.T, preferred_element_type=o))
        record("forward GEMM", out_dtype=jnp.dtype(out_dtype).name, ms=_time_ms(gemm, h, w))
    for chunk in chunks:
        fwd = jax.jit(lambda h, w, y, c=chunk: jaxops.linear_logprob_entropy(
            h, w, y, chunk_size=c))

        def fb(h, w, y, g, c=chunk):
            _, vjp = jax.vjp(lambda h, w: jaxops.linear_logprob_entropy(
                h, w, y, chunk_size=c), h, w)
            return vjp((g, g))

        try:
            record("linear_logprob_entropy", chunk=chunk, fwd_ms=_time_ms(fwd, h, w, y),
                   fb_ms=_time_ms(jax.jit(fb), h, w, y, g))
        except Exception as exc:  # noqa: BLE001 -- an OOM at a wide chunk: record, go on
            record("linear_logprob_entropy", chunk=chunk, error=str(exc)[:300])


if __name__ == "__main__":
    main()
