"""Multi-device checks behind tests/jaxops/test_sharding.py, run in a subprocess.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/jaxops/_sharding_worker.py PART

The flag fakes 8 CPU devices; it must be set before JAX starts, which is why
these checks run in their own process. A failing check raises AssertionError
naming its case (exit status 1); on success the last line is `RESULT {json}`
with what was measured. PARTs:

  matrix-xla, matrix-pallas  1, 2, 4 and 8 shards x every option of the core op x
                             every sharding mode x three scenarios, against the
                             unsharded op and the float64 reference: values and
                             gradients (Pallas in interpret mode).
  extra                      3 and 5 shards, logits also sharded over tokens (2-D
                             mesh), an eager wrapper call, T = 0, bad calls.
  hlo                        collectives in the compiled forward and gradient.
"""

from __future__ import annotations

import json
import os
import sys
import time

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "--xla_backend_optimization_level" not in _flags:
    # LLVM's optimisation level only (XLA's HLO passes, which place and merge the
    # collectives, are unchanged): about halves CPU compile time, which dominates here.
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))  # tests/jaxops
TESTS = os.path.dirname(HERE)
sys.path[:0] = [os.path.dirname(TESTS), TESTS, HERE]  # the repo, shared helpers, this folder

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxops  # noqa: E402
from _sharding_cases import (  # noqa: E402
    CONFIGS,
    PARSER_SELF_TEST,
    PARSER_SELF_TEST_EXPECTED,
    check_against_references,
    collectives,
    compare,
    config_inputs,
    expected64,
    make_datasets,
    mesh_1d,
    op_options,
    run_all_configs,
    sharded_fn,
    user_shard_map,
    value_and_vjp,
)

SHAPE = (4, 2)  # leading dims: T = 8 tokens; dim 0 splits over up to 4 token shards
VOCAB = 120  # divisible by 1, 2, 3, 4, 5, 8: V_loc = 120 ... 15
# Vocabulary tiles of 16: full tiles plus a partial one for V_loc = 120 ... 24 (1 to 5
# shards), a single partial tile for V_loc = 15 (8 shards).
BLOCK = jaxops.PallasConfig(block_v=16)
DATASETS = make_datasets(SHAPE, VOCAB)


def timed_run(mode, implementation, mesh, configs, datasets=DATASETS):
    start = time.perf_counter()
    out = run_all_configs(mode, implementation, mesh, datasets, configs, BLOCK)
    shards = None if mesh is None else mesh.size
    print(f"{implementation} {mode} shards={shards}: {time.perf_counter() - start:.1f}s",
          file=sys.stderr, flush=True)
    return out


def references_for(configs):
    return [{name: expected64(d, cfg) for name, cfg in configs.items()} for d in DATASETS]


# ------------------------------------------------------------------ matrix

def part_matrix(implementation):
    references = references_for(CONFIGS)
    unsharded = timed_run("plain_jit", implementation, None, CONFIGS)
    report = {}
    # Plain jit on global arrays is checked for correctness only (the wrapper is the
    # vocab-parallel path), on fewer shard counts.
    plain_jit_shards = (2, 8) if implementation == "xla" else (8,)
    for mode in ("shard_map_vma", "shard_map_novma", "wrapper", "plain_jit"):
        for num_shards in (1, 2, 4, 8):
            if mode == "plain_jit" and num_shards not in plain_jit_shards:
                continue
            mesh = mesh_1d(num_shards)
            label = f"{implementation} {mode} shards={num_shards}"
            if implementation == "pallas" and mode == "shard_map_vma":
                check_interpret_vma_refused(mesh)
                report[label] = "NotImplementedError (Pallas interpret mode)"
                continue
            results = timed_run(mode, implementation, mesh, CONFIGS)
            report[label] = check_against_references(
                label, results, unsharded, references, DATASETS, CONFIGS)
    return report


def check_interpret_vma_refused(mesh):
    """Pallas interpret mode under check_vma=True: our clear error, not a JAX crash."""
    cfg = CONFIGS["mask_tau"]
    data = DATASETS[0]
    logits, mask = config_inputs(data, cfg)
    fn = user_shard_map(cfg, "pallas", mesh, True, logits.ndim, BLOCK)
    try:
        jax.jit(fn)(logits, jnp.asarray(data["targets"]), mask)
    except NotImplementedError as err:
        assert "check_vma" in str(err), err
    else:
        raise AssertionError("Pallas interpret mode under check_vma=True should raise")


# ------------------------------------------------------------------ extra

def part_extra():
    report = {}
    configs = {k: CONFIGS[k] for k in ("mask_tau", "f16_nogradH")}
    references = references_for(configs)
    unsharded = {"xla": timed_run("plain_jit", "xla", None, configs),
                 "pallas": timed_run("plain_jit", "pallas", None, configs)}

    # Shard counts that are not powers of two (V = 120 = 3 * 40 = 5 * 24).
    for num_shards in (3, 5):
        for mode in ("shard_map_vma", "shard_map_novma"):
            label = f"xla {mode} shards={num_shards}"
            results = timed_run(mode, "xla", mesh_1d(num_shards), configs)
            report[label] = check_against_references(
                label, results, unsharded["xla"], references, DATASETS, configs)

    # Logits sharded over tokens too: a 2-D mesh (dp, tp), the wrapper with token_axis.
    for implementation in ("xla", "pallas"):
        for shape in ((2, 4), (4, 2)) if implementation == "xla" else ((2, 4),):
            mesh = jax.make_mesh(shape, ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
            label = f"{implementation} wrapper dp*tp={shape}"
            results = run_token_sharded(mesh, implementation, configs)
            report[label] = check_against_references(
                label, results, unsharded[implementation], references, DATASETS, configs)

    # An eager (un-jitted) wrapper call on global arrays.
    mesh = mesh_1d(4)
    cfg = CONFIGS["mask_tau"]
    data = DATASETS[1]
    logits, mask = config_inputs(data, cfg)
    got = jax.device_get(value_and_vjp(
        sharded_fn("wrapper", cfg, "xla", mesh, logits.ndim), logits,
        jnp.asarray(data["targets"]), mask, jnp.asarray(data["d_log_prob"]),
        jnp.asarray(data["d_entropy"])))
    compare("eager wrapper", got, references[1]["mask_tau"], data, cfg)

    check_empty_and_errors()
    return report


def run_token_sharded(mesh, implementation, configs):
    start = time.perf_counter()
    logits_sharding = NamedSharding(mesh, P("dp", None, "tp"))
    row_sharding = NamedSharding(mesh, P("dp", None))

    def fn_for(cfg):
        return lambda x, y, m: jaxops.vocab_parallel_logprob_entropy(
            x, y, keep_mask=m, mesh=mesh, vocab_axis="tp", token_axis="dp",
            **op_options(cfg, implementation, BLOCK))

    fns = {name: fn_for(cfg) for name, cfg in configs.items()}

    @jax.jit
    def run(inputs):
        return {name: value_and_vjp(fns[name], *inputs[name]) for name in fns}

    results = []
    for data in DATASETS:
        inputs = {}
        for name, cfg in configs.items():
            logits, mask = config_inputs(data, cfg)
            inputs[name] = (
                jax.device_put(logits, logits_sharding),
                jax.device_put(jnp.asarray(data["targets"]), row_sharding),
                None if mask is None else jax.device_put(mask, logits_sharding),
                jax.device_put(jnp.asarray(data["d_log_prob"]), row_sharding),
                jax.device_put(jnp.asarray(data["d_entropy"]), row_sharding))
        out = run(inputs)
        for name in configs:
            assert tuple(out[name][0].sharding.spec)[:1] == ("dp",), out[name][0].sharding
            assert tuple(out[name][2].sharding.spec) == ("dp", None, "tp"), out[name][2].sharding
        results.append(jax.device_get(out))
    print(f"{implementation} token-sharded {dict(mesh.shape)}: "
          f"{time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    return results


def expect_error(kind, fragment, fn):
    try:
        fn()
    except kind as err:
        assert fragment in str(err), (fragment, str(err))
    else:
        raise AssertionError(f"expected {kind.__name__} mentioning {fragment!r}")


def check_empty_and_errors():
    mesh = mesh_1d(4)
    call = jaxops.vocab_parallel_logprob_entropy
    x = jnp.zeros((0, VOCAB), jnp.float32)
    y = jnp.zeros((0,), jnp.int32)
    for check_vma in (True, False):
        fn = jax.shard_map(
            lambda x, y: jaxops.logprob_entropy(x, y, axis_name="tp", implementation="xla"),
            mesh=mesh, in_specs=(P(None, "tp"), P()), out_specs=(P(), P()),
            check_vma=check_vma)
        lp, h = jax.jit(fn)(x, y)
        assert lp.shape == (0,) and h.shape == (0,)
    lp, h = jax.jit(lambda x, y: call(x, y, mesh=mesh, vocab_axis="tp"))(x, y)
    assert lp.shape == (0,) and h.shape == (0,)

    x = jnp.zeros((4, VOCAB), jnp.float32)
    y = jnp.zeros((4,), jnp.int32)
    expect_error(ValueError, "split evenly", lambda: call(
        x[:, :118], y, mesh=mesh, vocab_axis="tp"))
    expect_error(ValueError, "vocab_axis", lambda: call(x, y, mesh=mesh, vocab_axis="dp"))
    expect_error(ValueError, "targets must", lambda: call(x, y[:3], mesh=mesh, vocab_axis="tp"))
    expect_error(ValueError, "keep_mask", lambda: call(
        x, y, keep_mask=jnp.ones((4, 60), bool), mesh=mesh, vocab_axis="tp"))
    expect_error(ValueError, "targets must lie in", lambda: call(
        x, y.at[2].set(VOCAB), mesh=mesh, vocab_axis="tp"))
    expect_error(ValueError, "reference", lambda: call(
        x, y, mesh=mesh, vocab_axis="tp", implementation="reference"))
    expect_error(TypeError, "mesh", lambda: call(x, y, mesh="tp", vocab_axis="tp"))
    expect_error(ValueError, "token_axis", lambda: call(
        x, y, mesh=mesh, vocab_axis="tp", token_axis="tp"))
    # Inside jit an out-of-range target gives NaN in its row (the other rows are fine).
    lp, _ = jax.jit(lambda x, y: call(x, y, mesh=mesh, vocab_axis="tp"))(x, y.at[2].set(VOCAB))
    lp = np.asarray(lp)
    assert np.isnan(lp[2]) and np.all(np.isfinite(np.delete(lp, 2))), lp


# ------------------------------------------------------------------ HLO

def part_hlo():
    """Compile the forward and forward+backward; count and size the collectives.

    The backward's collectives are the difference between the two; two cases also
    compile the backward alone, from the pullback's residuals, to show it directly.
    """
    assert collectives(PARSER_SELF_TEST) == PARSER_SELF_TEST_EXPECTED, \
        collectives(PARSER_SELF_TEST)
    num_shards = 4
    mesh = mesh_1d(num_shards)
    num_tokens = int(np.prod(SHAPE))
    local_size = num_tokens * VOCAB // num_shards  # T * V_loc
    max_per_token = 6  # the most floats per token any collective may carry
    report = {"T": num_tokens, "T*V_loc": local_size}
    data = DATASETS[0]
    targets = jnp.asarray(data["targets"])
    vocab_sharding = NamedSharding(mesh, P(*(None,) * len(SHAPE), "tp"))
    cases = [("xla", "shard_map_vma", "mask_tau"), ("xla", "shard_map_vma", "plain"),
             ("xla", "shard_map_novma", "mask_tau"), ("xla", "shard_map_novma", "plain"),
             ("xla", "wrapper", "mask_tau"), ("pallas", "shard_map_novma", "mask_tau"),
             ("pallas", "wrapper", "mask_tau"), ("xla", "plain_jit", "mask_tau")]
    for implementation, mode, name in cases:
        cfg = CONFIGS[name]
        logits, mask = config_inputs(data, cfg)
        fn = sharded_fn(mode, cfg, implementation, mesh, logits.ndim, BLOCK)
        if mode in ("wrapper", "plain_jit"):
            logits = jax.device_put(logits, vocab_sharding)
            mask = None if mask is None else jax.device_put(mask, vocab_sharding)
        cts = (jnp.asarray(data["d_log_prob"]), jnp.asarray(data["d_entropy"]))
        forward = collectives(jax.jit(fn).lower(logits, targets, mask).compile().as_text())
        both = collectives(jax.jit(lambda x, t, m, a, b: value_and_vjp(fn, x, t, m, a, b))
                           .lower(logits, targets, mask, *cts).compile().as_text())
        label = f"{implementation} {mode} {name}"
        report[label] = {"forward": forward, "forward+backward": both}
        if mode == "plain_jit":
            continue  # XLA's own partitioning of the jnp statistics: measured, not a contract
        for stage, found in (("forward", forward), ("forward+backward", both)):
            for op, size in found:
                assert op == "all-reduce", (label, stage, found)
                assert size <= max_per_token * num_tokens < local_size, (label, stage, found)
        assert len(forward) <= 2, (label, report[label])
        # check_vma=True (which the wrapper uses, except for interpreted Pallas): the
        # backward adds nothing. check_vma=False: one O(T) psum, the transpose of the
        # forward's psum.
        no_backward_collective = mode == "shard_map_vma" or (
            mode == "wrapper" and implementation != "pallas")
        assert len(both) - len(forward) == (0 if no_backward_collective else 1), (
            label, report[label])

    # The backward alone, compiled from the pullback's residuals.
    for mode in ("shard_map_vma", "shard_map_novma"):
        cfg = CONFIGS["mask_tau"]
        logits, mask = config_inputs(data, cfg)
        fn = sharded_fn(mode, cfg, "xla", mesh, logits.ndim)
        _, pullback = jax.vjp(lambda x: fn(x, targets, mask), logits)
        cts = (jnp.asarray(data["d_log_prob"]), jnp.asarray(data["d_entropy"]))
        backward = collectives(jax.jit(pullback).lower(cts).compile().as_text())
        report[f"xla {mode} mask_tau backward alone"] = backward
        assert len(backward) == (0 if mode == "shard_map_vma" else 1), (mode, backward)
        assert all(op == "all-reduce" and size <= max_per_token * num_tokens
                   for op, size in backward), (mode, backward)
    return report


def main():
    part = sys.argv[1]
    assert jax.device_count() >= 8, jax.devices()
    parts = {"matrix-xla": lambda: part_matrix("xla"),
             "matrix-pallas": lambda: part_matrix("pallas"),
             "extra": part_extra, "hlo": part_hlo}
    if part not in parts:
        raise SystemExit(f"unknown part {part!r}; one of {sorted(parts)}")
    print("RESULT " + json.dumps(parts[part]()), flush=True)


if __name__ == "__main__":
    main()
