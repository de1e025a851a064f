"""What the benchmark tests share (test_bench_harness.py, test_bench_tiny_run.py,
test_bench_head_and_tools.py): the repository's paths, a Python subprocess that must
succeed, and a check for optional modules."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_DIR = os.path.join(REPO, "benchmarks")


def run_python(*args, timeout=900, cwd=REPO, pythonpath=True):
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


def module_available(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
