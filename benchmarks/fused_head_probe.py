"""The fused head's forward kernel (`jaxops/linear_mosaic.py`, issue 13) checked and timed.

    python -m benchmarks.fused_head_probe          # CPU: interpret mode against XLA, tiny shapes
    python -m benchmarks.fused_head_probe --gpu [--shape T,H] [--variants ...]
        # GPU: against XLA, then timed next to the bf16 GEMM, the op's chunked forward
        # and its default forward, and per tile/pipeline/grid variant of the kernel

Each variant is `block_n,block_k,num_stages[,rc|cr[,chunk_v[,row_group]]]`: rc = grid
(rows, chunks), cr = grid (chunks, rows) (the kernel's default); row_group: one launch per
that many rows (0: one launch), e.g. `256,64,4,cr,2048,4096` at `--shape 16384,4096`. Times: one warm-up call, then the mean
of 5 calls back to back (harness.time_calls); V = 151,936, bf16, temperature 0.7.
Sessions 16-17's runs on the H200 are in benchmarks/NOTES.md.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import functools

import jax
import jax.numpy as jnp

from jaxops.linear_mosaic import forward_stats as fused_forward_stats


def relative_error(got, want, name) -> float:
    """Largest |got - want| / (|want| + 1e-6) of one `LocalStats` field."""
    import numpy as np

    a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
    return float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6)))


def main(argv=None):
    import argparse

    from jaxops import xla

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--variants", default="256,64,4,cr;256,64,4,rc;128,64,4,cr",
                        help="';'-separated block_n,block_k,num_stages[,grid order: "
                        "rc = (rows, chunks) or cr = (chunks, rows)[,chunk_v[,row_group "
                        "(0: none)]]] to time (--gpu)")
    parser.add_argument("--shape", default="4096,4096", help="T,H (--gpu; V = 151,936)")
    args = parser.parse_args(argv)
    interpret = not args.gpu
    T, H = (int(v) for v in args.shape.split(","))
    T, H, V = (128, 128, 1000) if interpret else (T, H, 151936)
    k = jax.random.split(jax.random.key(0), 3)
    h = (jax.random.normal(k[0], (T, H), jnp.float32) * 0.5).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (V, H), jnp.float32) / 8).astype(jnp.bfloat16)
    y = jax.random.randint(k[2], (T,), 0, V).astype(jnp.int32)
    tau = 0.7
    got = jax.jit(functools.partial(fused_forward_stats, inv_tau=1 / tau, with_entropy=True,
                                    interpret=interpret, chunk_v=256 if interpret else 2048))(
        h, w, y)
    logits = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
    want = xla.forward_stats(logits, y, None, inv_tau=1 / tau, with_entropy=True)
    worst = 0.0
    for name in ("max_logit", "sum_exp", "sum_exp_shifted", "target_logit"):
        err = relative_error(got, want, name)
        # The shifted sum (sum 2^d d) is signed and can be near 0 in a row: its
        # elementwise relative error is printed, not judged (session 17 saw 7e-2).
        worst = max(worst, err if name != "sum_exp_shifted" else 0.0)
        print(f"{name}: max relative error {err:.2e}", flush=True)
    if interpret:
        return 0 if worst < 1e-4 else 1

    import jaxops
    from benchmarks import harness

    def ms(fn, *args):  # one warm-up call, then 5 calls back to back: mean per call
        return harness.time_calls(fn, (args,), reps=1, calls=5,
                                  sync=harness.block_jax).seconds * 1e3

    print("bf16 GEMM ms", ms(jax.jit(lambda h, w: jnp.dot(h, w.T)), h, w), flush=True)
    from jaxops.pallas_config import PallasConfig

    # A PallasConfig keeps the chunked forward (`linear._fused_forward`).
    print("chunked forward ms", ms(jax.jit(lambda h, w, y: jaxops.linear_logprob_entropy(
        h, w, y, temperature=tau, pallas_config=PallasConfig())), h, w, y), flush=True)
    print("op forward (default) ms", ms(jax.jit(lambda h, w, y: jaxops.linear_logprob_entropy(
        h, w, y, temperature=tau)), h, w, y), flush=True)
    for variant in filter(None, args.variants.split(";")):
        block_n, block_k, num_stages, *rest = variant.split(",")
        block_n, block_k, num_stages = int(block_n), int(block_k), int(num_stages)
        order, chunk_v, row_group = (rest + ["cr", "2048", "0"][len(rest):])[:3]
        grid_order = {"rc": "rows,chunks", "cr": "chunks,rows"}[order]
        f = jax.jit(functools.partial(fused_forward_stats, inv_tau=1 / tau, with_entropy=True,
                                      block_n=block_n, block_k=block_k, chunk_v=int(chunk_v),
                                      num_stages=num_stages, grid_order=grid_order,
                                      row_group=int(row_group) or None))
        try:
            got = f(h, w, y)
            err = max(relative_error(got, want, n)
                      for n in ("max_logit", "sum_exp", "target_logit"))
            t = f"{ms(f, h, w, y):.3f} (max relative error {err:.1e})"
        except Exception as exc:  # a variant that does not compile is a result too
            t = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        print(f"fused forward block_n={block_n} block_k={block_k} stages={num_stages} "
              f"grid=({grid_order}) chunk_v={chunk_v} row_group={row_group} ms",
              t, flush=True)
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
