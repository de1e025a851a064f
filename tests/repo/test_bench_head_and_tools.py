"""The fused-head benchmark (`benchmarks/linear_head.py --device cpu --quick`, and
`plot_linear_head.py` on the committed H200 run) and the developer tools of
benchmarks/tools/ (kernel_asm, mosaic_tune, backend_choice), each run small on CPU.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from _bench_cases import BENCH_DIR, module_available, run_python


def test_linear_head_cpu_quick_has_every_row(tmp_path):
    """benchmarks/linear_head.py --device cpu --quick (tiny shapes, float32) runs end to end:
    every row of the run is in the JSON with a time or a status saying why not; the rows
    that need nothing beyond JAX, PyTorch and this project are measured and agree."""
    if not module_available("torch"):
        pytest.skip("linear_head.py compares against PyTorch, which is not installed")
    from benchmarks import linear_head, linear_head_impls
    out = tmp_path / "linear_head.json"
    stdout = run_python("-m", "benchmarks.linear_head", "--device", "cpu", "--quick",
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


def test_plot_linear_head_draws_the_committed_h200_run(tmp_path):
    """plot_linear_head.py turns the committed fused-head results into a PNG."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "head.png"
    run_python("-m", "benchmarks.plot_linear_head",
               os.path.join(BENCH_DIR, "results", "h200_linear_head.json"), "--out", str(png),
               timeout=120)
    assert png.stat().st_size > 10_000


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
