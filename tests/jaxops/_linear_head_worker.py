"""Vocab-parallel checks of `jaxops.linear_logprob_entropy`, run in a subprocess by
tests/jaxops/test_linear_head.py:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/jaxops/_linear_head_worker.py

Each shard holds rows `[i * V_loc, (i + 1) * V_loc)` of the weight (and the matching
mask columns); hidden and targets are replicated (`P()`). Values and the gradients to
hidden and weight, through `jax.vjp` from outside the user's `shard_map`, are compared
with the unsharded float64 reference, for 2 and 4 shards under check_vma True and
False; Pallas (interpret mode) under check_vma=False, and its clear error under True;
the fused Mosaic GPU kernels (interpret mode; also with a keep mask, switched on) under
check_vma=False on 2 shards (with a workaround for a race in jax 0.10.2's interpreter:
`_serialize_interpreter_barrier_check`).
The compiled HLO's collectives are counted. Last line on success: `RESULT {json}`.
"""

from __future__ import annotations

import json
import os
import sys

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=4"
if "--xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"  # faster CPU compiles
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))  # tests/jaxops
TESTS = os.path.dirname(HERE)
sys.path[:0] = [os.path.dirname(TESTS), TESTS, HERE]  # the repo, shared helpers, this folder

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxops  # noqa: E402
from _linear_cases import check_linear, make_linear_inputs, record_fused_traces  # noqa: E402
from _sharding_cases import collectives  # noqa: E402

LEAD, HIDDEN, VOCAB = (2, 3), 12, 40  # T = 6; V_loc = 20 or 10
CONFIGS = {
    "f32_mask": dict(dtype=jnp.float32, mask=True, temperature=0.7, with_entropy=True,
                     entropy_grad=True, chunk_size=4),
    "bf16_nogradH": dict(dtype=jnp.bfloat16, mask=False, temperature=1.3, with_entropy=True,
                         entropy_grad=False, chunk_size=5),
    "f32_mask_noH": dict(dtype=jnp.float32, mask=True, temperature=1.0, with_entropy=False,
                         entropy_grad=True, chunk_size=3),
}


def _serialize_interpreter_barrier_check():
    """Work around a race in jax 0.10.2's Mosaic GPU interpreter. Every device's program
    runs an interpreted kernel at once, against one shared model of all devices' memory;
    after its kernel each device asserts that *no* device still holds a barrier, while
    the other device may still be releasing its own ("Barrier remains allocated", with
    either fused kernel, or a hang). Here each device first waits for all of them at the
    interpreter's device barrier, then runs the same assertion, unchanged. Other jax
    versions without these internals run unpatched."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError:
        return
    if not hasattr(gpu_callbacks, "_assert_no_barriers_allocated"):
        return

    def assert_after_all_devices(token):
        shared = gpu_callbacks._get_shared_memory()
        shared.barrier.wait()
        shared.assert_no_barriers_allocated()
        return token

    gpu_callbacks._assert_no_barriers_allocated = assert_after_all_devices


def mesh_of(num_shards):
    return jax.make_mesh((num_shards,), ("tp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:num_shards])


def sharded(cfg, implementation, mesh, check_vma):
    def per_shard(hidden, weight, targets, mask):
        return jaxops.linear_logprob_entropy(
            hidden, weight, targets, keep_mask=mask, axis_name="tp",
            temperature=cfg["temperature"], with_entropy=cfg["with_entropy"],
            entropy_grad=cfg["entropy_grad"], implementation=implementation,
            chunk_size=cfg["chunk_size"])

    mask_spec = P(*(None,) * len(LEAD), "tp") if cfg["mask"] else None
    return jax.shard_map(
        per_shard, mesh=mesh, check_vma=check_vma,
        in_specs=(P(), P("tp", None), P(), mask_spec),
        out_specs=(P(), P() if cfg["with_entropy"] else None))


def value_and_vjp(fn, hidden, weight, targets, mask, g_lp, g_h):
    (log_prob, entropy), pullback = jax.vjp(
        lambda h, w: fn(h, w, targets, mask), hidden, weight)
    d_hidden, d_weight = pullback((g_lp, None if entropy is None else g_h))
    return log_prob, entropy, d_hidden, d_weight


def inputs(data, cfg):
    dtype = cfg["dtype"]
    return (jnp.asarray(data["hidden"], dtype), jnp.asarray(data["weight"], dtype),
            jnp.asarray(data["targets"]),
            None if data["mask"] is None else jnp.asarray(data["mask"]),
            jnp.asarray(data["d_log_prob"]), jnp.asarray(data["d_entropy"]))


def check(label, cfg, implementation, mesh, check_vma, data):
    fn = sharded(cfg, implementation, mesh, check_vma)
    got = jax.jit(lambda *a: value_and_vjp(fn, *a))(*inputs(data, cfg))
    return check_linear(label, jax.device_get(got), data, cfg["dtype"],
                        temperature=cfg["temperature"], with_entropy=cfg["with_entropy"],
                        entropy_grad=cfg["entropy_grad"])


def main():
    assert jax.device_count() >= 4, jax.devices()
    report = {}
    data = {name: make_linear_inputs(seed, LEAD, HIDDEN, VOCAB, cfg["dtype"], mask=cfg["mask"])
            for seed, (name, cfg) in enumerate(CONFIGS.items())}
    for num_shards in (2, 4):
        for check_vma in (True, False):
            for name, cfg in CONFIGS.items():
                if name == "f32_mask_noH" and num_shards == 4:
                    continue
                label = f"xla shards={num_shards} check_vma={check_vma} {name}"
                report[label] = check(label, cfg, "xla", mesh_of(num_shards), check_vma,
                                      data[name])
                print(label, report[label], file=sys.stderr, flush=True)

    cfg = CONFIGS["f32_mask"]
    label = "pallas shards=2 check_vma=False f32_mask"
    report[label] = check(label, cfg, "pallas", mesh_of(2), False, data["f32_mask"])
    try:
        check("pallas vma", cfg, "pallas", mesh_of(2), True, data["f32_mask"])
    except NotImplementedError as err:
        assert "check_vma" in str(err), err
        report["pallas shards=2 check_vma=True"] = "NotImplementedError"
    else:
        raise AssertionError("Pallas interpret mode under check_vma=True should raise")

    # The fused Mosaic GPU kernels (interpret mode) inside shard_map on 2 shards: T = 16,
    # H = 64, V_loc = 80 (their shapes: T % 8, H % 64, V_loc % 8), counted to show they
    # ran: without a mask in chunks of 24 columns (3 in the scan, then an 8-column tail);
    # with one in chunks of 32 (the mask's slices need 16-byte rows; a 16-column tail).
    _serialize_interpreter_barrier_check()
    traced = record_fused_traces()
    for masked, chunk, tail, seed in ((False, 24, 8, 7), (True, 32, 16, 8)):
        traced.clear()
        fused_cfg = dict(dtype=jnp.bfloat16, mask=masked, temperature=0.8, with_entropy=True,
                         entropy_grad=True, chunk_size=chunk)
        fused_data = make_linear_inputs(seed, (2, 8), 64, 160, jnp.bfloat16, mask=masked)
        label = (f"pallas_mosaic (fused kernels{', keep mask' if masked else ''}) shards=2 "
                 "check_vma=False bf16")
        report[label] = check(label, fused_cfg, "pallas_mosaic", mesh_of(2), False, fused_data)
        # forward once per shard program; backward: the tail chunk, then the scan body
        assert sorted(traced) == [("backward_logits", (16, 64), (tail, 64)),
                                  ("backward_logits", (16, 64), (chunk, 64)),
                                  ("forward_stats", (16, 64), (80, 64))], traced
        print(label, report[label], file=sys.stderr, flush=True)

    # Collectives: the forward's O(T) pmax + psum; the backward's sum of d hidden.
    num_tokens = int(np.prod(LEAD))
    args = inputs(data["f32_mask"], cfg)
    for check_vma in (True, False):
        fn = sharded(cfg, "xla", mesh_of(2), check_vma)
        forward = collectives(jax.jit(fn).lower(*args[:4]).compile().as_text())
        both = collectives(jax.jit(lambda *a: value_and_vjp(fn, *a))
                           .lower(*args).compile().as_text())
        report[f"collectives check_vma={check_vma}"] = {"forward": forward,
                                                        "forward+backward": both}
        assert len(forward) <= 2 and all(
            op == "all-reduce" and size <= 6 * num_tokens for op, size in forward), forward
        assert all(op == "all-reduce" and size <= num_tokens * HIDDEN for op, size in both), both
        # d hidden: one all-reduce of T * H elements (possibly merged with O(T) ones).
        assert sum(size >= num_tokens * HIDDEN for _, size in both) == 1, both
        # check_vma=True: only that one in the backward; check_vma=False: also the O(T)
        # psum that transposes the forward's psum (as for jaxops.logprob_entropy).
        assert len(both) - len(forward) == (1 if check_vma else 2), (forward, both)
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
