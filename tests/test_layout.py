"""Every module of jaxops/ and bridge/ imports on its own (no hidden import-order or
cycle dependence), in a fresh interpreter with the CPU backend."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for package in ("jaxops", "bridge") for p in (ROOT / package).glob("*.py"))

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
