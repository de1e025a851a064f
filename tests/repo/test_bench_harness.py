"""The benchmark harness's pieces, without a benchmark run: roofline bytes, the timing loop,
input blocks, the time budget, case selection, each backend's config, and `report.py` /
`tables.py` rendering the committed JSON into README.md's and docs/performance.md's tables.

The end-to-end `bench.py --tiny` run: test_bench_tiny_run.py; the fused-head benchmark and
the developer tools: test_bench_head_and_tools.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest

from _bench_cases import BENCH_DIR, REPO
from benchmarks import bench, cases, harness, report, tables  # stdlib-only at import time


def test_roofline_bytes():
    n = 8192 * 151_936
    assert harness.roofline_bytes("float32", 8192, 151_936, False) == (4 * n, 12 * n)
    assert harness.roofline_bytes("bfloat16", 8192, 151_936, True) == (2 * n + n, 6 * n + 2 * n)
    assert harness.roofline_bytes("float16", 8, 10, False) == (160, 480)
    # docs/performance.md's roofline (T = 8192, V = 151,936): bf16 with a dense bool mask
    fwd, fb = harness.roofline_bytes("bfloat16", 8192, 151_936, True)
    assert (round(fwd / 1e9, 3), round(fb / 1e9, 3)) == (3.734, 9.957)


def test_time_calls_rotates_warms_up_and_takes_the_median():
    calls, synced = [], []

    def fn(i):
        calls.append(i)
        return i

    timing = harness.time_calls(fn, [(0,), (1,), (2,)], reps=3, sync=synced.append,
                                calls=lambda est: harness.choose_calls(est, 3, 1.0, 7))
    assert timing.calls == 6  # max_calls 7, rounded down to a multiple of the 3 sets
    assert calls[0] == 1  # warm-up on the set the timed loop does not start on
    assert calls[1:] == [0, 1, 2] * 6  # every repetition starts on set 0 and rotates
    assert synced == [1, 2, 2, 2]  # after the warm-up and after each repetition
    assert len(timing.times) == 3 and list(timing.times) == sorted(timing.times)
    assert timing.seconds == timing.times[1]
    assert harness.time_calls(lambda: None, reps=4, calls=2, sync=id, warmup=0).seconds >= 0


def test_time_calls_keeps_one_output_alive():
    """The previous call's outputs are dropped before the next call: at fp32 T = 32,768 a
    forward+backward's outputs hold a 19.9 GB gradient, two of them would not fit."""
    live, peak = [0], [0]

    class Out:
        def __init__(self):
            live[0] += 1
            peak[0] = max(peak[0], live[0])

        def __del__(self):
            live[0] -= 1

    harness.time_calls(lambda: Out(), reps=3, calls=4, sync=lambda out: None, warmup=2)
    assert peak[0] == 1 and live[0] == 0


def test_inputs_are_made_in_row_blocks():
    from benchmarks.inputs import BLOCK_ELEMENTS, block_rows
    assert block_rows(32768, 151_936) == 512 and 512 * 151_936 <= BLOCK_ELEMENTS
    assert block_rows(8192, 151_936 // 8) == 4096
    assert block_rows(32, 1000) == 32 and block_rows(70, 10**9) == 35
    assert block_rows(33, 10**9) == 33  # odd T: one block


def test_budget_seconds():
    assert harness.budget_seconds("0") == 0.0
    assert harness.budget_seconds("450") == 450.0
    assert math.isinf(harness.budget_seconds("none"))
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(Exception, match="seconds >= 0"):
            harness.budget_seconds(bad)
    parser = bench.build_parser()
    assert parser.parse_args(["--budget-s", "0"]).budget_s == 0.0
    with pytest.raises(SystemExit):  # argparse: a clear error, not "no budget"
        parser.parse_args(["--budget-s", "-5"])


def test_filters_select_cases():
    filters = cases.parse_filters(["impl=jaxops-*,megatron", "dtype=bf16", "T=8192"])
    selected = cases.build_cases("quick", filters)
    # A glob matches every Pallas row, the ones left out of the default set too.
    assert {c.impl for c in selected} == {"jaxops-pallas", "jaxops-pallas_triton",
                                          "jaxops-pallas_mosaic", cases.MOSAIC_U8,
                                          "jaxops-xla", "megatron"}
    mosaic = cases.build_cases("quick", cases.parse_filters(["impl=jaxops-pallas_mosaic"]))
    assert mosaic and {c.impl for c in mosaic} == {"jaxops-pallas_mosaic"}
    # Default: the default "pallas" (on Hopper: the Mosaic kernels, bool masks in place) and
    # Triton (the pre-Hopper path), at every size, next to every baseline; not the explicit
    # Mosaic rows, which on Hopper time the default's kernels again.
    quick = cases.build_cases("quick", {})
    assert {c.impl for c in quick} == set(cases.DEFAULT_IMPLS)
    assert "jaxops-pallas" in cases.DEFAULT_IMPLS and "jaxops-pallas_triton" in cases.DEFAULT_IMPLS
    assert not set(cases.EXTRA_IMPLS) & set(cases.DEFAULT_IMPLS)
    per_impl = sum(c.impl == "jaxops-xla" for c in quick)
    for impl in ("jaxops-pallas", "jaxops-pallas_triton"):
        assert sum(c.impl == impl for c in quick) == per_impl
    # One device call: the quick set did not grow (116 cases with both explicit Mosaic rows).
    assert len(quick) == 112 and len(cases.build_cases("full", {})) == 256
    # The uint8-mask variant, when asked for: exactly the masked cases of the Mosaic rows.
    u8 = [c for c in selected if c.impl == cases.MOSAIC_U8]
    assert u8 and all(c.mask for c in u8)
    assert ({dataclasses.replace(c, impl="jaxops-pallas_mosaic") for c in u8}
            == {c for c in selected if c.impl == "jaxops-pallas_mosaic" and c.mask})
    assert all(c.dtype == "bfloat16" and c.T == 8192 for c in selected)
    assert {c.V for c in selected} == {151_936, 151_936 // 8}
    selected = cases.build_cases("full", cases.parse_filters(["entropy=no;mask=yes"]))
    assert selected and all(not c.entropy and c.mask for c in selected)
    # What allocates from torch's pool (the bridge too) runs first of all at the large
    # size (JAX's pool never shrinks), then the headline size.
    full = cases.build_cases("full", {})
    big_torch = [c for c in full if c.T == 32768 and c.impl in cases.TORCH_POOL_IMPLS]
    assert any(c.impl == "bridge" for c in big_torch)
    assert full[:len(big_torch)] == big_torch
    assert (full[len(big_torch)].T, full[len(big_torch)].V) == (8192, 151_936)
    with pytest.raises(SystemExit):
        cases.parse_filters(["colour=red"])


def test_docs_tables_are_the_committed_json():
    """report.py renders the committed JSONs to exactly the docs' tables: the H200 run to
    docs/performance.md's full tables, the H100 run (issue 34: the README's table from a
    committed H100 run) to the README's short table (links relative to each file's folder)."""
    docs = os.path.join(REPO, "docs")
    h200 = os.path.join(BENCH_DIR, "results", "h200.json")
    md = report.markdown(tables.load(h200), h200, os.path.join(BENCH_DIR, "results", "h200.png"),
                         base=docs)
    with open(os.path.join(docs, "performance.md")) as f:
        performance = f.read()
    assert report.START + "\n" + md + report.END in performance
    assert "](../benchmarks/results/h200.json)" in md
    h100 = os.path.join(BENCH_DIR, "results", "h100.json")
    results = tables.load(h100)
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    summary = report.summary_md(results, h100)
    assert report.SUMMARY_START + "\n" + summary + report.SUMMARY_END in readme
    assert "](benchmarks/results/h100.json)" in summary and "H100" in summary
    assert results["git"]["commit"] and not results["git"]["dirty"]
    assert report.START not in readme  # the full tables live in docs/performance.md


def test_each_backend_gets_its_own_config(monkeypatch):
    """--pallas-config reaches the Triton kernels (and the alias), --mosaic-config Mosaic's."""
    import jax
    import jaxops
    from jaxops.backends.mosaic.config import MosaicConfig
    from benchmarks import impls
    triton = harness.pallas_config("block_v=1024,prefetch=1")
    mosaic = harness.mosaic_config("block_v=256,approx_math=0,chunk_v=none")
    assert mosaic == MosaicConfig(block_v=256, approx_math=False)
    calls = []
    monkeypatch.setattr(jaxops, "logprob_entropy", lambda *a, **kw: calls.append(kw))
    implementations = impls.Implementations(None, jax, tau=1.0, on_gpu=False,
                                            pallas_config=triton, mosaic_config=mosaic)
    expected = {"jaxops-pallas_triton": ("pallas_triton", triton),
                "jaxops-pallas_mosaic": ("pallas_mosaic", mosaic),
                "jaxops-pallas": ("pallas", triton), "jaxops-xla": ("xla", None)}
    for impl, (name, config) in expected.items():
        implementations.jax_forward_fn(cases.Case(impl, "float32", 4, 8, True, False))(1, 2, None)
        assert (calls[-1]["implementation"], calls[-1]["pallas_config"]) == (name, config)


def test_a_broken_bridge_is_an_error_not_a_skip(monkeypatch):
    """bench.py imports PyTorch, so a bridge that fails to import is broken: its cases
    raise (the row says "error: ..."), they are not skipped."""
    from benchmarks import impls
    monkeypatch.setitem(sys.modules, "bridge", None)  # `import bridge` now raises
    implementations = impls.Implementations(None, None, tau=1.0, on_gpu=False)
    case = cases.Case("bridge", "float32", 4, 8, True, False)
    with pytest.raises(RuntimeError, match="bridge not importable"):
        implementations.torch_forward_fn(case)


def test_report_describes_the_run_the_rows_come_from():
    """After --append has measured every row again, the README header and the plot's
    title name that run (its commit, date, bandwidth), not the file's first run."""
    first = {"date": "d0", "git": {"commit": "aaaaaaa"}, "bandwidth": {"used_Bps": 1e12}}
    later = {"date": "d1", "git": {"commit": "bbbbbbb"}, "bandwidth": {"used_Bps": 2e12}}
    rows = [{"run": 1}, {"run": 1}]
    results = {**first, "runs": [first, later], "rows": rows}
    assert tables.rows_run(results) == ([1], {**results, **later})
    mixed = {**results, "rows": [{"run": 0}, {"run": 1}]}
    assert tables.rows_run(mixed) == ([0, 1], mixed)
