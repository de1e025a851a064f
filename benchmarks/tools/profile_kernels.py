"""Launch the Pallas forward/backward kernels once per variant, for a profiler to read.

    ncu --clock-control none --kernel-name regex:logprob_entropy --section LaunchStats \
        --section Occupancy --section SpeedOfLight --section WarpStateStats \
        python -m benchmarks.tools.profile_kernels --variants "dtype=bf16,case=ent;dtype=bf16,case=ent,prefetch=1"

Each variant is `dtype=bf16|fp32`, `case=ent|noent|mask|mask-noent`, `phase=fwd|fwd_bwd`
(default fwd) and any `PallasConfig` field (block_v=1024, num_warps=8, prefetch=1, ...),
at T = 8192, V = 151,936 unless `T=` / `V=` say otherwise. Every variant runs one call
after its compile, in the order given, so the profiler's kernel list follows that order
(printed here with a `[profile]` prefix). No timing: use tune.py / bench.py for that.
"""
if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import argparse

import jax
import jax.numpy as jnp

import jaxops
from benchmarks.harness import pallas_config

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
_CASE_KEYS = ("dtype", "case", "phase", "T", "V")


def parse_variant(text):
    spec = dict(dtype="bf16", case="ent", phase="fwd", T="8192", V="151936")
    spec.update(kv.split("=") for kv in filter(None, text.split(",")))
    return spec, pallas_config({k: v for k, v in spec.items() if k not in _CASE_KEYS})


def run_variant(spec, config):
    T, V, dtype = int(spec["T"]), int(spec["V"]), DTYPES[spec["dtype"]]
    case = spec["case"]
    x = jax.random.normal(jax.random.key(0), (T, V), dtype) * 3
    y = jax.random.randint(jax.random.key(1), (T,), 0, V)
    mask = (jax.random.uniform(jax.random.key(2), (T, V)) < 0.05) if "mask" in case else None

    def op(x, y, mask):  # arrays as arguments: a captured mask would be an HLO constant
        return jaxops.logprob_entropy(x, y, keep_mask=mask, with_entropy="noent" not in case,
                                      implementation="pallas_triton", pallas_config=config)

    if spec["phase"] == "fwd":
        fn = jax.jit(op)
    else:
        fn = jax.jit(jax.grad(lambda x, y, mask: sum(
            jnp.sum(o) for o in op(x, y, mask) if o is not None)))
    jax.block_until_ready(fn(x, y, mask))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", required=True, help="';'-separated variants")
    args = parser.parse_args()
    print("[profile]", jax.devices()[0].device_kind, jax.__version__, flush=True)
    for index, text in enumerate(filter(None, args.variants.split(";"))):
        spec, config = parse_variant(text)
        print(f"[profile] {index}: {text} -> {config}", flush=True)
        run_variant(spec, config)


if __name__ == "__main__":
    main()
