"""Re-execute notebooks top to bottom and save them with fresh outputs.

    python notebooks/execute.py                      # notebooks/precision.ipynb, in place
    python notebooks/execute.py NOTEBOOK [--output OUT] [--timeout SECONDS]

The kernel is this interpreter (kernel name "python3"; jupyter_client starts a kernel
spec whose command is "python" with sys.executable), run with the notebook's folder as
working directory and this repository on PYTHONPATH. Exits non-zero if any cell raises.

The executed notebook records a hash of its cells' sources in its metadata
(`jaxops.sources_sha256`), so a test can tell whether the committed outputs belong to
the committed sources (see tests/repo/test_notebook_examples.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
NOTEBOOKS = [HERE / "precision.ipynb"]


def sources_hash(nb) -> str:
    """sha256 of the notebook's cell types and sources (not outputs, not metadata)."""
    cells = [[cell["cell_type"], cell["source"]] for cell in nb["cells"]]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()


def execute(path: pathlib.Path, output: pathlib.Path | None = None, timeout: int = 900):
    """Execute `path`; write the executed notebook to `output` (default: in place).

    Returns (executed notebook, seconds)."""
    import nbclient
    import nbformat

    path = pathlib.Path(path)
    nb = nbformat.read(path, as_version=4)
    env_path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in env_path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env_path) if p)
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3",
        resources={"metadata": {"path": str(path.resolve().parent)}})
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    nb.metadata["jaxops"] = {"sources_sha256": sources_hash(nb),
                             "executed_in_s": round(elapsed)}
    nbformat.validate(nb)
    nbformat.write(nb, output or path)
    return nb, elapsed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", default=[str(p) for p in NOTEBOOKS])
    parser.add_argument("--output", default=None, help="write here instead of in place "
                        "(one notebook only)")
    parser.add_argument("--timeout", type=int, default=900, help="per-cell timeout, seconds")
    args = parser.parse_args(argv)
    if args.output and len(args.notebooks) != 1:
        parser.error("--output takes one notebook")
    for name in args.notebooks:
        output = pathlib.Path(args.output) if args.output else None
        _, elapsed = execute(pathlib.Path(name), output, args.timeout)
        print(f"executed {name} in {elapsed:.0f} s -> {output or name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
