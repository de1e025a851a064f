"""The benchmark harness cannot rot: `benchmarks/bench.py --tiny` runs end to end on CPU,
and `plot.py` / `report.py` turn its JSON into a PNG and the docs' tables.

No timing is asserted (CPU numbers mean nothing); the checks are that every expected row is
there, that measured numbers are positive and finite, that statuses are the documented ones,
and that the generated markdown lands between the markers of README.md and
docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import bench, cases, harness, report, tables  # stdlib-only at import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_DIR = os.path.join(REPO, "benchmarks")
ENTRY_SCRIPTS = ("bench", "report", "plot", "bridge_overhead", "linear_head",
                 "plot_linear_head", "tools/tune", "tools/profile_kernels", "tools/gpu_smoke",
                 "tools/kernel_asm", "tools/mosaic_tune", "tools/backend_choice",
                 "tools/bridge_backend_choice")


def _run(*args, timeout=900, cwd=REPO, pythonpath=True):
    """`python *args` (a script's path, or -m benchmarks.NAME); its stdout."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    else:
        env.pop("PYTHONPATH", None)
    env.pop("XLA_FLAGS", None)  # no fake multi-device CPU here
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _module_available(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    if not _module_available("torch"):
        pytest.skip("bench.py compares against PyTorch, which is not installed")
    out = tmp_path_factory.mktemp("bench") / "cpu.json"
    stdout = _run("-m", "benchmarks.bench", "--tiny", "--device-name", "cpu-test",
                  "--out", str(out))
    assert "speed-up of jaxops-pallas " in stdout  # the default "pallas" heads the tables
    with open(out) as f:
        return out, json.load(f)


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


@pytest.mark.slow
def test_entry_scripts_run_by_path_and_as_modules(tmp_path):
    """`python benchmarks/X.py` from anywhere, without PYTHONPATH, and `python -m
    benchmarks.X` from the repository root."""
    for name in ENTRY_SCRIPTS:
        out = _run(os.path.join(BENCH_DIR, f"{name}.py"), "--help", cwd=tmp_path,
                   pythonpath=False)
        assert "usage:" in out, name
    assert _run("-m", "benchmarks.bench", "--dry-run", "--tiny").endswith("32 cases (tiny)\n")
    assert _run(os.path.join(BENCH_DIR, "bench.py"), "--dry-run", "--tiny", cwd=tmp_path,
                pythonpath=False).endswith("32 cases (tiny)\n")


def test_docs_tables_are_the_committed_json():
    """report.py renders the committed H200 JSON to exactly docs/performance.md's tables
    and the README's short table (links relative to each file's folder)."""
    json_path = os.path.join(BENCH_DIR, "results", "h200.json")
    png_path = os.path.join(BENCH_DIR, "results", "h200.png")
    results = tables.load(json_path)
    docs = os.path.join(REPO, "docs")
    with open(os.path.join(docs, "performance.md")) as f:
        performance = f.read()
    md = report.markdown(results, json_path, png_path, base=docs)
    assert report.START + "\n" + md + report.END in performance
    assert "](../benchmarks/results/h200.json)" in md
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    summary = report.summary_md(results, json_path)
    assert report.SUMMARY_START + "\n" + summary + report.SUMMARY_END in readme
    assert "](benchmarks/results/h200.json)" in summary and "H200" in summary
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
    if _module_available("megatron.core"):
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
    _run(os.path.join("benchmarks", "plot.py"), str(json_path), "--out", str(png))  # by path
    assert png.exists() and png.stat().st_size > 10_000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    text = _run("-m", "benchmarks.report", str(json_path), "--text")
    assert "jaxops-pallas_triton" in text and "speed-up of jaxops-pallas " in text

    readme, performance = tmp_path / "README.md", tmp_path / "performance.md"
    readme.write_text("# title\n\n<!-- perf-summary:start -->\nold summary\n"
                      "<!-- perf-summary:end -->\n")
    performance.write_text("# title\n\nbefore\n\n<!-- perf-table:start -->\nold table\n"
                           "<!-- perf-table:end -->\n\nafter\n")
    _run("-m", "benchmarks.report", str(json_path), "--png", str(png),
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
    stdout = _run(os.path.join("benchmarks", "bench.py"), "--tiny", "--append",
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


def test_linear_head_cpu_quick_has_every_row(tmp_path):
    """benchmarks/linear_head.py --device cpu --quick (tiny shapes, float32) runs end to end:
    every row of the run is in the JSON with a time or a status saying why not; the rows
    that need nothing beyond JAX, PyTorch and this project are measured and agree."""
    if not _module_available("torch"):
        pytest.skip("linear_head.py compares against PyTorch, which is not installed")
    from benchmarks import linear_head, linear_head_impls
    out = tmp_path / "linear_head.json"
    stdout = _run("-m", "benchmarks.linear_head", "--device", "cpu", "--quick",
                  "--reps", "2", "--max-calls", "2", "--out", str(out), timeout=120)
    assert "| implementation | entropy | fwd ms | fwd+bwd ms |" in stdout
    results = json.loads(out.read_text())
    assert results["complete"] is True and results["dtype"] == "float32"
    assert results["versions"]["jax"] and results["versions"]["torch"]
    assert "commit" in results["git"]
    rows = {(r["impl"], r["T"], r["H"], r["entropy"]): r for r in results["rows"]}
    T, H = linear_head.CPU_CASE
    fixed_entropy = linear_head_impls.FIXED_ENTROPY
    expected = {(impl, T, H, fixed_entropy.get(impl) if not per_entropy else True)
                for impl, (_, _, per_entropy) in linear_head_impls.IMPLS.items()}
    assert set(rows) == expected
    for key, row in rows.items():
        timed = all(row.get(f"{p}_ms", 0) > 0 and math.isfinite(row[f"{p}_ms"])
                    for p in ("fwd", "fb"))
        assert timed or (isinstance(row["status"], str) and row["status"] != "ok"), key
        assert timed == (row["status"] == "ok"), key
    must_run = ("gemm-jax", "gemm-torch", "jaxops-fused", "bridge-fused", "jax-unfused",
                "torch-bridge")
    for impl in must_run:
        row = next(r for r in results["rows"] if r["impl"] == impl)
        assert row["status"] == "ok", (impl, row["status"])
        assert row["fb_tflops"] > 0 and row["fb_x_floor"] > 0
    # torch.compile is skipped on the CPU; Liger / verl run only where they import
    assert rows[("torch-compile", T, H, True)]["status"].startswith("skipped: torch.compile")
    for impl in ("liger", "verl"):
        assert rows[(impl, T, H, fixed_entropy[impl])]["status"].startswith("skipped"), impl
    # the same inputs everywhere: log-prob and entropy means agree across implementations
    means = [(r["lp_mean"], r["h_mean"]) for r in results["rows"] if "lp_mean" in r]
    assert len(means) == 4
    for lp, h in means:
        assert lp == pytest.approx(means[0][0], rel=1e-4) and lp < 0
        assert h == pytest.approx(means[0][1], rel=1e-4) and h > 0
    # the JAX rows report their temporaries (buffer assignment works on the CPU)
    assert rows[("jaxops-fused", T, H, True)]["fb_extra_bytes"] is not None


def test_kernel_asm_sees_a_kernel_change(monkeypatch):
    """benchmarks/tools/kernel_asm.py (the refactor check): the same kernel prints the same
    text twice, without source locations, and a different kernel prints differently."""
    pytest.importorskip("jaxops.backends.mosaic.direct")
    import jax.numpy as jnp

    from benchmarks.tools import kernel_asm

    def partials_text(config, inv_tau=None):  # None: as kernel_asm builds it (1 / 0.7)
        (name, fn, structs), *_ = kernel_asm.kernels([config])
        assert name.startswith("partials")
        if inv_tau is not None:
            from jaxops.backends.mosaic import direct as md

            T, V, dtype, masked, with_entropy = config
            fn = md.partials_kernel(T, V, dtype, masked=masked, with_entropy=with_entropy,
                                    inv_tau=inv_tau)
        (text,) = kernel_asm.kernel_modules(fn, structs)
        return text

    config = (64, 1024, jnp.float32, False, True)
    first = partials_text(config)
    assert "loc(" not in first and len(first) > 1000
    assert partials_text(config) == first
    assert partials_text(config, inv_tau=1 / 0.9) != first


def test_mosaic_tune_measures_and_checks(monkeypatch):
    """benchmarks/tools/mosaic_tune.py on CPU (kernels interpreted, a small vocabulary): a
    kernel row carries its check against XLA, an API row its times."""
    import jax.numpy as jnp

    from benchmarks.tools import mosaic_tune
    from jaxops.backends.mosaic.config import MosaicConfig

    monkeypatch.setattr(mosaic_tune, "V", 1040)
    row = mosaic_tune.run_case(70, jnp.float32, True,
                               MosaicConfig(interpret=True, chunk_v=512), bandwidth=1e9)
    assert row["max_lse_err"] < 1e-4 and row["fwd_ms"] > 0 and row["bwd_ms"] > 0
    api = mosaic_tune.api_case(jnp.float32, False, jnp.uint8, bandwidth=1e9, num_tokens=70)
    assert api["mask"] == "uint8" and api["fwd_ms"] > 0 and api["fb_ms"] > 0


def test_backend_choice_times_both_backends():
    """benchmarks/tools/backend_choice.py on CPU (both backends interpreted, tiny shapes): one
    row holds a forward and a forward+backward time per backend."""
    import jax.numpy as jnp

    from benchmarks.tools import backend_choice

    row = backend_choice.run_case(8, 64, jnp.float32, True, reps=1, calls=2)
    assert (row["T"], row["V"], row["dtype"], row["entropy"]) == (8, 64, "float32", True)
    for impl in backend_choice.IMPLS:
        assert len(row[impl]) == 2 and min(row[impl]) > 0


def test_plot_linear_head_draws_the_committed_h200_run(tmp_path):
    """plot_linear_head.py turns the committed fused-head results into a PNG."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "head.png"
    _run("-m", "benchmarks.plot_linear_head",
         os.path.join(BENCH_DIR, "results", "h200_linear_head.json"), "--out", str(png),
         timeout=120)
    assert png.stat().st_size > 10_000
