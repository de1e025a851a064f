"""Which Pallas backend is faster, per shape (issue 14): what `implementation="pallas"`
picks is read off this (`jaxops.backends.registry.pallas_backend`, MOSAIC_MIN_VOCAB).

    python -m benchmarks.tools.backend_choice [--out FILE.json] [--quick]

Times `jaxops.logprob_entropy` with implementation "pallas_triton" and "pallas_mosaic",
jitted, forward and forward+backward (`jax.grad` of the outputs' sum), no mask, over
the vocabulary shard width V_loc (T = 8192; bf16/fp32 x entropy on/off) and over T
at V = 151,936 (bf16 with entropy). Times: median of 5 rounds of 20 back-to-back
calls over 2 input sets (harness.time_calls). Prints and writes one row per case:
{T, V, dtype, entropy, <impl>: [forward us, forward+backward us]}.
"""
if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp

from benchmarks import harness

IMPLS = ("pallas_triton", "pallas_mosaic")


def cases(quick):
    by_vocab = [(8192, v, d, e) for v in (37984, 75968, 18992, 151936)
                for d in (jnp.bfloat16, jnp.float32) for e in (True, False)]
    by_tokens = [(t, 151936, jnp.bfloat16, True) for t in (512, 2048, 4096)]
    return (by_vocab[:2] if quick else by_vocab + by_tokens)


def run_case(num_tokens, num_vocab, dtype, with_entropy, impls=IMPLS, reps=5, calls=20):
    import jaxops

    sets = []
    for seed in (0, 1):
        k1, k2 = jax.random.split(jax.random.key(seed))
        sets.append(((jax.random.normal(k1, (num_tokens, num_vocab), jnp.float32) * 3
                      ).astype(dtype), jax.random.randint(k2, (num_tokens,), 0, num_vocab)))
    row = dict(T=num_tokens, V=num_vocab, dtype=jnp.dtype(dtype).name, entropy=with_entropy)
    for impl in impls:
        def op(x, y, impl=impl):
            return jaxops.logprob_entropy(x, y, with_entropy=with_entropy, implementation=impl)

        def loss(x, y):
            return sum(jnp.sum(o) for o in op(x, y) if o is not None)

        row[impl] = [round(harness.time_calls(jax.jit(f), sets, reps=reps, calls=calls,
                                              sync=jax.block_until_ready).seconds * 1e6, 1)
                     for f in (op, jax.grad(loss))]
    return row


def main():
    harness.run_case_table(__doc__.splitlines()[0], cases, run_case)


if __name__ == "__main__":
    main()
