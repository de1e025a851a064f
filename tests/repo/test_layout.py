"""The house rules of jaxops/ and bridge/: every module imports on its own (no hidden
import-order or cycle dependence), in a fresh interpreter with the CPU backend; no file
over 450 lines (benchmarks/, benchmarks/tools/, every file of tests/ and examples/ too); no
module of jaxops/ uses another module's underscore-prefixed names (bridge/:
tests/repo/test_bridge_layout.py); `import jaxops` loads no Pallas lowering."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for package in ("jaxops", "bridge") for p in (ROOT / package).rglob("*.py"))
MAX_LINES = 450
# The line limit covers the benchmark scripts and their developer tools, the tests (every
# folder of tests/) and the examples as well.
LINE_LIMITED = sorted(
    [p for folder in ("jaxops", "bridge", "tests") for p in (ROOT / folder).rglob("*.py")]
    + [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "benchmarks" / "tools").glob("*.py"),
       *(ROOT / "examples").glob("*.py")])

_CODE = """
import importlib, sys, traceback
failures = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ("jaxops", "bridge")]:
        del sys.modules[loaded]  # each module alone: nothing of the project imported before
    try:
        importlib.import_module(name)
    except Exception:
        failures.append(name + ": " + traceback.format_exc(limit=3))
print("\\n".join(failures) or "ok")
"""


def test_every_module_imports_alone():
    assert len(MODULES) > 15, MODULES
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CODE, *MODULES], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok", done.stdout


def test_no_file_over_the_line_limit():
    assert {p.parent.name for p in LINE_LIMITED} >= {"jaxops", "bridge", "benchmarks", "tools",
                                                     "tests", "repo", "examples"}
    long = {str(p.relative_to(ROOT)): n for p in LINE_LIMITED
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


_NAMEDTUPLE_API = ("_fields", "_replace", "_asdict", "_make")  # public, despite the "_"


def _private_uses(path: pathlib.Path) -> list[str]:
    """`from jaxops.x import _y`, and `module._y` on a module imported from jaxops."""
    tree = ast.parse(path.read_text())
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxops"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.name}:{node.lineno} from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name.startswith("jaxops"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in _NAMEDTUPLE_API):
            found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    found = [use for p in sorted((ROOT / "jaxops").rglob("*.py")) for use in _private_uses(p)]
    assert not found, found


def test_private_name_check_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from jaxops.staged import _x\nfrom jaxops import staged\nstaged._y\n")
    assert len(_private_uses(bad)) == 2


def test_import_jaxops_loads_no_pallas_lowering():
    """Beyond what `import jax` loads: the kernels modules are imported on first use."""
    code = ("import sys, jax; before = set(sys.modules); import jaxops; "
            "print(sorted(m for m in set(sys.modules) - before if ('mosaic' in m or "
            "'triton' in m) and not m.endswith(('.config', '.triton', '.mosaic'))))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
