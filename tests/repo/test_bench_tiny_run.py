"""The benchmark harness cannot rot: `benchmarks/bench.py --tiny` runs end to end on CPU,
and `plot.py` / `report.py` turn its JSON into a PNG and the docs' tables; every entry script
starts by path and as a module.

No timing is asserted (CPU numbers mean nothing); the checks are that every expected row is
there, that measured numbers are positive and finite, that statuses are the documented ones,
and that the generated markdown lands between the markers of README.md and
docs/performance.md.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from _bench_cases import BENCH_DIR, module_available, run_python
from benchmarks import cases, tables  # stdlib-only at import time

ENTRY_SCRIPTS = ("bench", "report", "plot", "bridge_overhead", "linear_head",
                 "plot_linear_head", "tools/tune", "tools/profile_kernels", "tools/gpu_smoke",
                 "tools/kernel_asm", "tools/mosaic_tune", "tools/backend_choice",
                 "tools/bridge_backend_choice")


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    if not module_available("torch"):
        pytest.skip("bench.py compares against PyTorch, which is not installed")
    out = tmp_path_factory.mktemp("bench") / "cpu.json"
    stdout = run_python("-m", "benchmarks.bench", "--tiny", "--device-name", "cpu-test",
                        "--out", str(out))
    assert "speed-up of jaxops-pallas " in stdout  # the default "pallas" heads the tables
    with open(out) as f:
        return out, json.load(f)


@pytest.mark.slow
def test_entry_scripts_run_by_path_and_as_modules(tmp_path):
    """`python benchmarks/X.py` from anywhere, without PYTHONPATH, and `python -m
    benchmarks.X` from the repository root."""
    for name in ENTRY_SCRIPTS:
        out = run_python(os.path.join(BENCH_DIR, f"{name}.py"), "--help", cwd=tmp_path,
                         pythonpath=False)
        assert "usage:" in out, name
    assert run_python("-m", "benchmarks.bench", "--dry-run", "--tiny").endswith("32 cases (tiny)\n")
    assert run_python(os.path.join(BENCH_DIR, "bench.py"), "--dry-run", "--tiny", cwd=tmp_path,
                      pythonpath=False).endswith("32 cases (tiny)\n")


@pytest.mark.slow
def test_tiny_run_has_every_row(tiny_results):
    _, results = tiny_results
    assert results["complete"] is True and results["mode"] == "tiny"
    assert results["device_name"] == "cpu-test"
    assert results["versions"]["jax"] and results["versions"]["torch"]
    assert "commit" in results["git"] and results["date"]
    bw = results["bandwidth"]
    assert bw["used_Bps"] > 0 and bw["used"] in ("torch_copy_Bps", "torch_scale_Bps",
                                                  "jax_scale_Bps")
    expected = {c.key for c in cases.build_cases("tiny", {})}
    rows = {(r["impl"], r["dtype"], r["T"], r["V"], r["entropy"], r["mask"]): r
            for r in results["rows"]}
    assert set(rows) == expected
    assert {r["impl"] for r in results["rows"]} == set(cases.DEFAULT_IMPLS)

    # The bridge must run: PyTorch is installed (the fixture skips otherwise), so a bridge
    # that fails to import is broken, and its row says "error: ...", which fails here.
    must_run = {"jaxops-pallas", "jaxops-pallas_triton", "jaxops-xla", "jax-jit", "torch-eager",
                "bridge"}
    if module_available("megatron.core"):
        must_run.add("megatron")
    for key, row in rows.items():
        impl = row["impl"]
        status = row["status"]
        if impl == "megatron" and (row["entropy"] or row["mask"]):
            assert status.startswith("n/a"), (key, status)
            continue
        if impl == "torch-compile":
            assert status.startswith("skipped: torch.compile"), (key, status)
            continue
        if impl == "megatron" and impl not in must_run:
            assert status.startswith("skipped: megatron-core not usable"), (key, status)
            continue
        assert impl in must_run, (key, status)
        assert status == "ok", (key, status, row.get("fwd_status"), row.get("fb_status"))
        for phase in ("fwd", "fb"):
            for field in ("ms", "roof_ms", "x_roof"):
                value = row[f"{phase}_{field}"]
                assert value > 0 and math.isfinite(value), (key, phase, field, value)
            assert row[f"{phase}_calls"] >= 2
        assert row["fb_bytes"] > row["fwd_bytes"] > 0
        assert math.isfinite(row["lp_mean"]) and row["lp_mean"] < 0
        if row["entropy"]:
            assert row["h_mean"] > 0
        if impl.startswith("jaxops-pallas"):  # the kernels ran, no fallback to XLA
            assert not row.get("fwd_warnings") and not row.get("fb_warnings"), key
        if row["framework"] == "jax":  # buffer assignment: the gradient is an output
            assert row["fb_peak_extra_bytes"] >= row["grad_bytes"]
    ours = [s for s in results["speedups"] if s["fb"] is not None]
    assert ours and all(s["fb"] > 0 and s["fwd"] > 0 for s in ours)
    # Triton / the default, at the one combo each runs in --tiny
    assert {s["ours"] for s in ours} == {"jaxops-pallas"}
    assert any(s["anchor"] == "jaxops-pallas_triton" for s in ours)
    # Nothing of an earlier case is alive when a case starts (runner.py's doc: a case's
    # peak is its own inputs, outputs and temporaries).
    assert results["default_impl"] == "jaxops-pallas"
    started = [r for r in results["rows"] if "jax_live_bytes_at_start" in r]
    assert {r["impl"] for r in started} >= must_run - {"megatron"}
    for row in started:
        live = row["jax_live_bytes_at_start"]
        assert live is not None and live < 4096, (row["impl"], live)


@pytest.mark.slow
def test_plot_and_report(tiny_results, tmp_path):
    json_path, results = tiny_results
    png = tmp_path / "cpu.png"
    run_python(os.path.join("benchmarks", "plot.py"), str(json_path), "--out", str(png))  # by path
    assert png.exists() and png.stat().st_size > 10_000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    text = run_python("-m", "benchmarks.report", str(json_path), "--text")
    assert "jaxops-pallas_triton" in text and "speed-up of jaxops-pallas " in text

    readme, performance = tmp_path / "README.md", tmp_path / "performance.md"
    readme.write_text("# title\n\n<!-- perf-summary:start -->\nold summary\n"
                      "<!-- perf-summary:end -->\n")
    performance.write_text("# title\n\nbefore\n\n<!-- perf-table:start -->\nold table\n"
                           "<!-- perf-table:end -->\n\nafter\n")
    run_python("-m", "benchmarks.report", str(json_path), "--png", str(png),
               "--update-readme", "--readme", str(readme), "--performance", str(performance))
    summary = readme.read_text()
    assert "old summary" not in summary and "| dtype | entropy | mask | roofline ms |" in summary
    updated = performance.read_text()
    assert "old table" not in updated
    assert updated.startswith("# title\n\nbefore\n\n<!-- perf-table:start -->\n")
    assert updated.endswith("<!-- perf-table:end -->\n\nafter\n")
    section = updated.split("<!-- perf-table:start -->")[1].split("<!-- perf-table:end -->")[0]
    assert "| dtype | entropy | mask | roofline ms |" in section
    assert f"T = {results['rows'][0]['T']:,}" in section
    # Traceable: the headline numbers are the JSON's, formatted.
    for impl in ("jaxops-pallas", "jaxops-pallas_triton"):  # a column each
        pallas = next(r for r in results["rows"] if r["impl"] == impl and r["status"] == "ok")
        assert tables.ms(pallas["fb_ms"]) in section and tables.ms(pallas["fwd_ms"]) in section
        assert f"| {tables.labels(results)[impl]} ms | × roofline |" in section
    # The default row is the headline, named as such; files without "default_impl" (the
    # committed h200.json) keep the old names (test_docs_tables_are_the_committed_json).
    assert "| jaxops (default) ms | × roofline | jaxops (Pallas Triton) ms |" in section
    assert "| roofline ms | jaxops (default) ms |" in summary
    assert tables.labels({})["jaxops-pallas"] == "jaxops (Pallas)"
    assert "cpu.png" in section


@pytest.mark.slow
def test_append_keeps_measured_rows_over_skipped_ones(tiny_results, tmp_path):
    """--append replaces re-measured rows, but a case the new run skips (here: a spent time
    budget; --budget-s 0 starts no case) keeps its earlier measurement, with a note naming
    both runs."""
    json_path, results = tiny_results
    out = tmp_path / "appended.json"
    out.write_text(json_path.read_text())
    stdout = run_python(os.path.join("benchmarks", "bench.py"), "--tiny", "--append",
                        "--filter", "impl=jaxops-xla", "--budget-s", "0",
                        "--device-name", "cpu-test", "--out", str(out))
    assert "kept from run 0" in stdout
    appended = json.loads(out.read_text())
    assert len(appended["runs"]) == 2
    key = lambda r: (r["impl"], r["dtype"], r["T"], r["V"], r["entropy"], r["mask"])
    before = {key(r): r for r in results["rows"]}
    after = {key(r): r for r in appended["rows"]}
    assert set(after) == set(before)  # nothing lost, nothing doubled
    xla = [k for k in after if k[0] == "jaxops-xla"]
    assert xla
    for k in xla:
        assert after[k]["status"] == "ok" and after[k]["fb_ms"] == before[k]["fb_ms"], k
        assert after[k]["note"].startswith("kept from run 0: run 1 was skipped: time budget")
    for k in after:
        if k[0] != "jaxops-xla":
            assert after[k] == before[k], k


def test_sizes_run_in_priority_order_without_the_gpu():
    """--process-per-size: the headline size first although `build_cases` puts the big
    torch rows of T = 32,768 at the front; the children's argv drops the parent's budget,
    --append and the setting itself (whatever their spelling)."""
    from benchmarks import size_processes

    quick = cases.build_cases("quick", {})
    assert (quick[0].T, quick[0].V) == (32768, cases.V_FULL)
    assert size_processes.sizes(quick, "quick")[0] == (cases.MAIN_T, cases.MAIN_V)
    assert len(size_processes.sizes(quick, "quick")) == 4
    assert not size_processes.wanted("on", cases.build_cases("quick", {"T": ["1024"]}), "quick")
    assert not size_processes.wanted("off", quick, "quick")
    assert size_processes.without_options(
        ["--quick", "--budget-s", "400", "--append", "--process-per-size=on", "--out", "x"],
        {"--budget-s", "--append", "--process-per-size"}) == ["--quick", "--out", "x"]


@pytest.mark.slow
def test_process_per_size_writes_one_file(tmp_path):
    """Every size in a process of its own (what a GPU run does by default), on CPU: one
    JSON with every case's row, one run per size, and a spent budget reaching the children."""
    if not module_available("torch"):
        pytest.skip("bench.py compares against PyTorch, which is not installed")
    out = tmp_path / "sizes.json"
    common = ("-m", "benchmarks.bench", "--tiny", "--process-per-size", "on", "--filter",
              "impl=jaxops-xla", "--device-name", "cpu-test", "--out", str(out))
    stdout = run_python(*common)
    assert "size 3 of 3" in stdout
    results = json.loads(out.read_text())
    expected = {c.key for c in cases.build_cases("tiny", {"impl": ["jaxops-xla"]})}
    rows = {(r["impl"], r["dtype"], r["T"], r["V"], r["entropy"], r["mask"]): r
            for r in results["rows"]}
    assert set(rows) == expected and len(results["rows"]) == len(expected)
    assert len(results["runs"]) == 3 and results["complete"] is True
    runs_by_size = {}
    for r in results["rows"]:
        assert r["status"] == "ok", r
        runs_by_size.setdefault((r["T"], r["V"]), set()).add(r["run"])
    assert sorted(min(v) for v in runs_by_size.values()) == [0, 1, 2]
    assert all(len(v) == 1 for v in runs_by_size.values())
    stdout = run_python(*common, "--budget-s", "0")
    skipped = json.loads(out.read_text())["rows"]
    assert len(skipped) == len(expected)
    assert all(r["status"].startswith("skipped: time budget") for r in skipped)
