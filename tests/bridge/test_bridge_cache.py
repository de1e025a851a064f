"""The bridge's persistent compilation cache (bridge/cache.py) and `bridge.warmup`.

Across processes (each a fresh `tests/bridge/_cache_worker.py`, a few in parallel): a second
process loads every program from the cache and gets bit-identical results; a changed
dtype or shape misses (no wrong reuse); damaged entries and an unwritable directory
give warnings and correct results; `JAXOPS_CACHE_DIR=off` writes nothing; a JAX cache
the user configured is left as configured; two processes filling one directory at once
both succeed. In this process: the direct route's kernel store, and the warm-up.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

import bridge
from bridge import cache

WORKER = pathlib.Path(__file__).with_name("_cache_worker.py")
ROOT = WORKER.parents[2]


def _start(env_extra, cases, unset=("JAXOPS_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR")):
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, str(WORKER), *cases], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _entries(folder) -> list:
    return [p for p in pathlib.Path(folder).rglob("*") if p.is_file()
            and not p.name.startswith(".")] if os.path.exists(folder) else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache")
    blocker = tmp / "a_file"
    blocker.write_text("not a directory")
    user = {"JAX_COMPILATION_CACHE_DIR": str(tmp / "u"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    first = {  # both_a and both_b fill one empty directory at the same time
        "both_a": _start({"JAXOPS_CACHE_DIR": str(tmp / "d1")}, ["f32", "bf16"]),
        "both_b": _start({"JAXOPS_CACHE_DIR": str(tmp / "d1")}, ["f32", "bf16"]),
        "off": _start({"JAXOPS_CACHE_DIR": "off", "XDG_CACHE_HOME": str(tmp / "x1")}, ["f32"]),
        "unwritable": _start({"JAXOPS_CACHE_DIR": str(blocker / "sub")}, ["f32"]),
        "user": _start({**user, "XDG_CACHE_HOME": str(tmp / "x2")}, ["f32"]),
    }
    res = {name: _finish(p) for name, p in first.items()}
    # Damage every entry of the user's JAX cache (same length, other bytes). JAX's key
    # includes the cache's path (jax 0.10), so a damaged copy elsewhere would just miss.
    damaged = [p for p in _entries(tmp / "u") if p.name.endswith("-cache")]
    for p in damaged:
        p.write_bytes(b"\x00" * p.stat().st_size)
    second = {
        "warm": _start({"JAXOPS_CACHE_DIR": str(tmp / "d1")}, ["f32", "bf16", "f32_wide"]),
        "corrupt": _start(user, ["f32"]),
    }
    res.update({name: _finish(p) for name, p in second.items()})
    res["cold"] = res["both_a"]
    return res, tmp, len(damaged)


def test_second_process_loads_from_cache_bit_identical(runs):
    res, tmp, _ = runs
    cold, warm = res["cold"]["cases"]["f32"], res["warm"]["cases"]["f32"]
    # (Its twin filling the directory at the same time may have written some first.)
    requests = cold["cache_misses"] + cold["cache_hits"]
    assert requests >= 2  # (4, 1)-row windows
    assert warm["cache_hits"] == requests and warm["cache_misses"] == 0
    assert res["warm"]["cases"]["bf16"]["cache_hits"] >= 2
    assert warm["digest"] == cold["digest"] == res["off"]["cases"]["f32"]["digest"]
    assert cold["max_err"] < 1e-5
    assert res["cold"]["cache_dir"].startswith(str(tmp / "d1"))
    assert any(p.parent.name == "xla" for p in _entries(tmp / "d1"))
    assert not res["cold"]["warnings"] and not res["warm"]["warnings"]


def test_changed_dtype_or_shape_is_a_miss(runs):
    res, _, _ = runs
    bf16 = res["cold"]["cases"]["bf16"]  # after f32 in the same process and directory
    assert bf16["cache_misses"] + bf16["cache_hits"] >= 2 and bf16["max_err"] < 0.1
    assert res["warm"]["cases"]["bf16"]["digest"] == bf16["digest"]
    wide = res["warm"]["cases"]["f32_wide"]  # V_loc 128: nothing cached fits
    assert wide["cache_misses"] >= 2 and wide["cache_hits"] == 0 and wide["max_err"] < 1e-5


def test_damaged_entries_warn_and_recompile(runs):
    res, _, num_damaged = runs
    got = res["corrupt"]
    assert num_damaged >= 2
    assert got["cases"]["f32"]["digest"] == res["cold"]["cases"]["f32"]["digest"]
    assert any("persistent compilation cache" in w for w in got["warnings"]), got["warnings"]


def test_unwritable_directory_warns_and_compiles(runs):
    res, _, _ = runs
    got = res["unwritable"]
    assert got["cases"]["f32"]["digest"] == res["cold"]["cases"]["f32"]["digest"]
    assert got["cache_dir"] is None and got["jax_cache_dir"] is None
    assert sum("compilation cache off" in w for w in got["warnings"]) == 1, got["warnings"]


def test_off_writes_nothing(runs):
    res, tmp, _ = runs
    got = res["off"]
    assert got["cache_dir"] is None and got["jax_cache_dir"] is None
    assert got["cases"]["f32"]["cache_hits"] == got["cases"]["f32"]["cache_misses"] == 0
    assert not _entries(tmp / "x1")


def test_user_configured_jax_cache_is_respected(runs):
    res, tmp, _ = runs
    got = res["user"]
    assert got["jax_cache_dir"] == got["cache_dir"] == str(tmp / "u")
    assert got["jax_max_size"] == -1  # JAX's default: the bridge changed none of it
    assert any(p.name.endswith("-cache") for p in _entries(tmp / "u"))
    assert not _entries(tmp / "x2")  # nothing in the bridge's default folder


def test_two_processes_fill_one_directory_at_once(runs):
    res, _, _ = runs
    for name in ("both_a", "both_b"):
        assert not res[name]["warnings"], res[name]["warnings"]
        for case in ("f32", "bf16"):
            assert (res[name]["cases"][case]["digest"]
                    == res["warm"]["cases"][case]["digest"]), (name, case)


# ----------------------------------------------- the direct route's kernel entries

def test_kernel_store_round_trip_and_damage(tmp_path):
    module = bytes(range(256)) * 5
    assert cache.load_kernel("k", folder=tmp_path) is None
    cache.store_kernel("k", module, 3, folder=tmp_path)
    assert cache.load_kernel("k", folder=tmp_path) == (module, 3)
    data = bytearray((tmp_path / "k").read_bytes())
    data[-1] ^= 1
    (tmp_path / "k").write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert cache.load_kernel("k", folder=tmp_path) is None
    (tmp_path / "k").write_bytes(b"jaxops")  # truncated
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert cache.load_kernel("k", folder=tmp_path) is None
    cache.store_kernel("k", module, 3, folder=tmp_path)  # rewritten whole
    assert cache.load_kernel("k", folder=tmp_path) == (module, 3)


def test_kernel_store_concurrent_writers_and_unwritable(tmp_path):
    modules = [bytes([i]) * 100_000 for i in range(8)]
    threads = [threading.Thread(target=cache.store_kernel, args=("k", m, i, tmp_path))
               for i, m in enumerate(modules)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    module, num = cache.load_kernel("k", folder=tmp_path)
    assert module == modules[num]  # one writer's whole entry
    assert [p.name for p in tmp_path.iterdir()] == ["k"]  # no temporary left behind
    blocker = tmp_path / "k"
    with pytest.warns(RuntimeWarning, match="cannot write"):
        cache.store_kernel("x", module, 1, folder=blocker)


# --------------------------------------------------------------------- the warm-up

def test_warmup_compiles_what_later_calls_need():
    lines = []
    tau = 0.8125  # a configuration no other test compiles
    report = bridge.warmup(8, 64, dtype=torch.float32, device="cpu", temperature=tau,
                           progress=lines.append)
    assert report.windows == (1, 2, 4, 8)
    assert report.programs == 8  # a forward and a backward per window size
    assert len(lines) == 9 and lines[-1].startswith("bridge.warmup: 8 programs")
    before = bridge.compiled_programs()
    gen = torch.Generator().manual_seed(1)
    for T in (3, 8, 5, 1, 7, 6):
        x = torch.randn(T, 64, generator=gen).requires_grad_()
        lp, ent = bridge.logprob_entropy(x, torch.randint(0, 64, (T,), generator=gen),
                                         temperature=tau)
        (lp.sum() + ent.sum()).backward()
    assert bridge.compiled_programs() == before


def test_warmup_fused_head():
    tau = 0.6875
    report = bridge.warmup(6, 32, hidden_size=16, dtype=torch.float32, device="cpu",
                           temperature=tau, progress=False)
    assert report.windows == (1, 2, 4) and report.programs > 0
    before = bridge.compiled_programs()
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(32, 16, generator=gen).requires_grad_()
    for T in (5, 3, 6, 1, 4):
        hidden = torch.randn(T, 16, generator=gen).requires_grad_()
        lp, ent = bridge.linear_logprob_entropy(
            hidden, weight, torch.randint(0, 32, (T,), generator=gen), temperature=tau)
        (lp.sum() + ent.sum()).backward()
    assert bridge.compiled_programs() == before


def test_warmup_with_threads_compiles_the_same_programs():
    # Window sizes warmed at once must leave nothing for later calls to compile, the
    # fused head's shared weight included (each step takes its own leaf of it).
    lines = []
    tau = 0.5625
    report = bridge.warmup(8, 64, dtype=torch.float32, device="cpu", temperature=tau,
                           progress=lines.append, threads=3)
    assert report.windows == (1, 2, 4, 8) and report.programs == 8
    assert len(lines) == 9 and "program" not in lines[0]  # per-step lines: seconds only
    before = bridge.compiled_programs()
    gen = torch.Generator().manual_seed(3)
    for T in (3, 8, 5, 1):
        x = torch.randn(T, 64, generator=gen).requires_grad_()
        lp, ent = bridge.logprob_entropy(x, torch.randint(0, 64, (T,), generator=gen),
                                         temperature=tau)
        (lp.sum() + ent.sum()).backward()
    assert bridge.compiled_programs() == before
    report = bridge.warmup(6, 32, hidden_size=16, dtype=torch.float32, device="cpu",
                           temperature=0.4375, progress=False, threads=2)
    assert report.programs > 0
    before = bridge.compiled_programs()
    weight = torch.randn(32, 16, generator=gen).requires_grad_()
    for T in (5, 3, 6, 1, 4):
        hidden = torch.randn(T, 16, generator=gen).requires_grad_()
        lp, ent = bridge.linear_logprob_entropy(
            hidden, weight, torch.randint(0, 32, (T,), generator=gen), temperature=0.4375)
        (lp.sum() + ent.sum()).backward()
    assert bridge.compiled_programs() == before


def test_warmup_rejects_no_threads():
    with pytest.raises(ValueError, match="threads"):
        bridge.warmup(8, 64, device="cpu", threads=0)
