"""CI runs the precision notebook and both examples end to end (CPU).

- The notebook is executed with nbclient into a temporary file (the committed notebook is
  never overwritten); every cell must run without error, in a kernel that is this very
  interpreter, and produce its figures and findings. The committed notebook must carry
  outputs executed from its current sources (a hash recorded by notebooks/execute.py).
- Each example runs as a subprocess; it must exit 0 and print its success line. Each is
  also run with a deliberate fault and must then fail, so that its checks are known to bite.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "precision.ipynb"


def _load_execute():
    """notebooks/execute.py as a module (it is a script, not a package member)."""
    spec = importlib.util.spec_from_file_location("notebook_execute",
                                                  REPO / "notebooks" / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _missing(*modules):
    return [m for m in modules if importlib.util.find_spec(m) is None]


# JAX reports (warns about) any program that captures more constants than this: an array a
# jitted function closes over instead of taking it as an argument. O(T) vectors stay below
# it at every size the examples and the notebook run; a captured [T, V] array does not.
CAPTURED_CONSTANTS_LIMIT = str(64 * 1024)
CAPTURED = "constants were captured"


def _run(args, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["JAX_CAPTURED_CONSTANTS_WARN_BYTES"] = CAPTURED_CONSTANTS_LIMIT
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def _outputs_text(cell):
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        for key in ("text/plain", "text/markdown"):
            if key in out.get("data", {}):
                parts.append(out["data"][key])
    return "".join(parts)


def _images(nb):
    return sum("image/png" in out.get("data", {})
               for cell in nb.cells for out in cell.get("outputs", []))


# ----------------------------------------------------------------------------- notebook

def test_committed_notebook_outputs_belong_to_its_sources():
    nbformat = pytest.importorskip("nbformat")
    execute = _load_execute()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), \
        "the committed notebook has unexecuted cells: run python notebooks/execute.py"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), \
        "cells were not executed top to bottom in one session"
    assert not any(out.get("output_type") == "error" for c in code for out in c.outputs)
    recorded = nb.metadata.get("jaxops", {}).get("sources_sha256")
    assert recorded == execute.sources_hash(nb), \
        "the notebook's sources changed after its outputs were made: python notebooks/execute.py"
    assert _images(nb) >= 6
    assert "Top-p rollouts need the nucleus" in _outputs_text(code[-1])


@pytest.mark.slow
def test_notebook_executes(tmp_path, monkeypatch):
    missing = _missing("nbclient", "nbformat", "ipykernel", "matplotlib")
    if missing:
        pytest.skip(f"notebook dependencies not installed: {missing}")
    monkeypatch.setenv("JAX_CAPTURED_CONSTANTS_WARN_BYTES", CAPTURED_CONSTANTS_LIMIT)  # kernel env
    execute = _load_execute()
    before = NOTEBOOK.read_bytes()
    out = tmp_path / "precision.ipynb"
    nb, elapsed = execute.execute(NOTEBOOK, output=out, timeout=600)
    assert NOTEBOOK.read_bytes() == before, "the committed notebook must not be overwritten"
    assert out.exists()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    # The kernel is this interpreter (the venv's python), not whatever "python" is on PATH.
    assert f"python   {sys.executable}\n" in _outputs_text(code[0])
    assert _images(nb) >= 6, "a figure is missing"
    findings = _outputs_text(code[-1])
    for n in range(1, 8):
        assert f"**{n}. " in findings, f"finding {n} missing"
    assert not re.search(r"\b(nan|inf)\b", findings, re.IGNORECASE), findings
    captured = [c.source[:80] for c in code if CAPTURED in _outputs_text(c)]
    assert not captured, f"cells whose jitted functions capture arrays: {captured}"
    print(f"notebook executed in {elapsed:.0f} s")


# ----------------------------------------------------------------------------- examples

@pytest.mark.slow
def test_jax_grpo_example():
    rc, out, err = _run(["examples/jax_grpo.py"])
    assert rc == 0, out[-3000:] + err[-3000:]
    assert CAPTURED not in err, err[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("GRPO OK") and "loss went down" in last and "reward went up" in last


@pytest.mark.slow
def test_jax_grpo_example_fails_without_keep_mask():
    # Without the rollout's top-p mask the trainer's log-probs disagree with the rollout's.
    rc, out, err = _run(["examples/jax_grpo.py", "--no-keep-mask", "--iterations", "2"])
    assert rc == 1, out[-3000:] + err[-3000:]
    assert "GRPO FAILED" in out and "trainer and rollout log-probs differ" in out


@pytest.mark.slow
def test_torch_ppo_example():
    if _missing("megatron"):
        pytest.skip("megatron-core is not installed")
    rc, out, err = _run(["examples/torch_ppo.py"])
    assert rc == 0, out[-3000:] + err[-3000:]
    assert CAPTURED not in err, err[-3000:]
    assert "FAIL" not in out
    assert out.strip().splitlines()[-1].startswith("PPO step matches Megatron")


@pytest.mark.slow
def test_torch_ppo_example_catches_a_gradient_bug():
    # A 0.05% error in the gradient, well inside one bf16 rounding (0.39%): the comparison
    # in bf16 catches it.
    if _missing("megatron"):
        pytest.skip("megatron-core is not installed")
    rc, out, err = _run(["examples/torch_ppo.py", "--bug", "grad-scale",
                         "--tokens", "64", "--vocab", "8192"])
    assert rc == 1, out[-3000:] + err[-3000:]
    assert "FAIL policy grad vs Megatron in bf16" in out
    assert out.strip().splitlines()[-1].startswith("PPO step MISMATCH")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_torch_ppo_loop_example(tp):
    """50 micro-batches of varying T on a small transformer policy, TP = 1 and 2 (gloo):
    every step's parameter gradients match float64 and Megatron; compiles stay bounded."""
    if _missing("megatron"):
        pytest.skip("megatron-core is not installed")
    rc, out, err = _run(["examples/torch_ppo_loop.py", "--device", "cpu", "--tp", str(tp),
                         "--steps", "50", "--max-tokens", "96", "--vocab", "256"])
    assert rc == 0, out[-3000:] + err[-3000:]
    assert "FAIL" not in out
    steps = [line for line in out.splitlines() if line[:5].strip().isdigit()]
    assert len(steps) == 50 and len({line.split()[1] for line in steps}) > 20, (
        "the loop did not run 50 micro-batches of many different T")
    assert out.strip().splitlines()[-1].startswith("PPO loop OK: 50 steps")


@pytest.mark.slow
def test_torch_ppo_loop_example_catches_a_gradient_bug():
    if _missing("megatron"):
        pytest.skip("megatron-core is not installed")
    rc, out, err = _run(["examples/torch_ppo_loop.py", "--device", "cpu", "--tp", "1",
                         "--steps", "3", "--max-tokens", "32", "--vocab", "256",
                         "--bug", "grad-scale"])
    assert rc == 1, out[-3000:] + err[-3000:]
    assert "d params vs float64" in out
    assert out.strip().splitlines()[-1].startswith("PPO loop MISMATCH")
