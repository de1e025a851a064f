"""Vocab-parallel op on CPU: 1 to 8 fake devices, every sharding mode, collectives.

The multi-device checks need `XLA_FLAGS=--xla_force_host_platform_device_count=8`
before JAX starts, so they run in subprocesses (tests/jaxops/_sharding_worker.py, and
examples/multihost.py as two cooperating processes); this process's JAX is
left alone. The subprocesses start together when the first of these tests runs,
as many at a time as there are CPU cores, and each test waits for its own.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxops
from jaxops.contract import varying_axes, varying_struct

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_sharding_worker.py")
EXAMPLE = ROOT / "examples" / "multihost.py"
WORKER_PARTS = ("matrix-pallas", "extra", "matrix-xla", "hlo")  # longest first
TIMEOUT_S = 1200


def _env(device_count=8):
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={device_count}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _run_worker(part):
    done = subprocess.run([sys.executable, str(WORKER), part], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    return done.returncode, done.stdout, done.stderr


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_multihost():
    """examples/multihost.py as 2 processes x 2 CPU devices, vocabulary over all 4."""
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--cpu-devices", "2", "--tp", "4", "--tokens", "16",
         "--vocab", "96", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i)],
        env=_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append((proc.returncode, out))
    return outputs


@pytest.fixture(scope="module")
def background(request):
    """Starts every selected subprocess job at once (bounded by the core count)."""
    module = sys.modules[__name__]
    wanted = []
    for item in request.session.items:
        if getattr(item, "module", None) is not module:
            continue
        if item.originalname == "test_worker_part":
            wanted.append(("worker", item.callspec.params["part"]))
        elif item.originalname == "test_multihost_example_two_processes":
            wanted.append(("multihost", None))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))
    jobs = {}
    for kind, part in wanted:
        if (kind, part) not in jobs:
            jobs[kind, part] = (pool.submit(_run_worker, part) if kind == "worker"
                                else pool.submit(_run_multihost))
    yield jobs
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.parametrize("part", WORKER_PARTS)
def test_worker_part(part, background):
    """matrix-*: 1/2/4/8 shards == unsharded op == float64 reference, values and
    gradients, every option, every sharding mode; extra: 3/5 shards, token-sharded
    2-D meshes, eager wrapper, T = 0, bad calls; hlo: collective counts and sizes."""
    returncode, stdout, stderr = background["worker", part].result(timeout=TIMEOUT_S)
    if returncode != 0:
        pytest.fail(f"worker part {part!r} failed (exit {returncode}):\n{stderr[-6000:]}")
    results = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert results, stdout[-2000:]
    report = json.loads(results[-1][len("RESULT "):])
    print(f"\n{part}: {json.dumps(report, indent=1)}")
    assert report


def test_multihost_example_two_processes(background):
    """examples/multihost.py, two processes under jax.distributed.initialize()."""
    outputs = background["multihost", None].result(timeout=TIMEOUT_S)
    for index, (returncode, out) in enumerate(outputs):
        assert returncode == 0, f"process {index} failed:\n{out[-4000:]}"
        assert f"[process {index}/2] OK" in out, out[-2000:]
        assert "mesh dp=1 tp=4" in out, out[-2000:]


# ------------------------------------------------------------------ in this process
# One CPU device here (no XLA flag), so meshes of size 1.

def _mesh1():
    return jax.make_mesh((1,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])


def test_varying_struct_outside_shard_map_is_plain():
    x = jnp.zeros((3, 5))
    assert varying_axes(x, None) == frozenset()
    struct = varying_struct((3,), jnp.float32, x)
    assert struct.shape == (3,) and struct.dtype == jnp.float32


@pytest.mark.parametrize("check_vma", [True, False])
def test_varying_axes_inside_shard_map(check_vma):
    seen = {}

    def body(x, y):
        seen["x"], seen["y"] = varying_axes(x), varying_axes(y)
        seen["struct"] = varying_struct((2,), jnp.float32, y, x)
        return x

    jax.shard_map(body, mesh=_mesh1(), in_specs=(P(None, "tp"), P()),
                  out_specs=P(None, "tp"), check_vma=check_vma)(jnp.zeros((2, 4)), jnp.zeros(2))
    if check_vma:
        assert seen["x"] == {"tp"} and seen["y"] == frozenset()
        assert set(seen["struct"].manual_axis_type.varying) == {"tp"}
    else:
        assert seen["x"] == seen["y"] == frozenset()


def test_pallas_interpret_under_check_vma_is_a_clear_error():
    fn = jax.shard_map(
        lambda x, y: jaxops.logprob_entropy(x, y, implementation="pallas", axis_name="tp"),
        mesh=_mesh1(), in_specs=(P(None, "tp"), P()), out_specs=(P(), P()), check_vma=True)
    with pytest.raises(NotImplementedError, match="check_vma"):
        fn(jnp.zeros((2, 16), jnp.float32), jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize("implementation", ["xla", "pallas", "pallas_mosaic"])
def test_wrapper_on_one_device_matches_unsharded(implementation):
    # V = 48: a width the Mosaic kernels take with a mask (a multiple of 16).
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(0, 2, (6, 48)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 48, 6), jnp.int32)
    mask = jnp.asarray(rng.random((6, 48)) < 0.4)
    options = dict(keep_mask=mask, temperature=0.8, implementation=implementation)

    def loss(fn, x):
        lp, h = fn(x, targets, **options)
        return jnp.sum(lp * jnp.arange(6)) - jnp.sum(h), (lp, h)

    wrapped = jax.jit(jax.value_and_grad(lambda x: loss(lambda *a, **k: (
        jaxops.vocab_parallel_logprob_entropy(*a, mesh=_mesh1(), vocab_axis="tp", **k)), x),
        has_aux=True))
    (value, (lp, h)), grad = wrapped(logits)
    (value0, (lp0, h0)), grad0 = jax.value_and_grad(
        lambda x: loss(jaxops.logprob_entropy, x), has_aux=True)(logits)
    np.testing.assert_allclose(lp, lp0, atol=1e-5)
    np.testing.assert_allclose(h, h0, atol=1e-5)
    np.testing.assert_allclose(grad, grad0, atol=1e-5)
    assert np.abs(np.asarray(grad)).max() > 0.1
