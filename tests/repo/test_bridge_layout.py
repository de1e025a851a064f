"""The bridge's modules talk to each other only through public names.

Read with `ast`, never imported: every .py file under bridge/, examples/ and benchmarks/.
(a) Nothing outside bridge/ reaches into it past its public surface: no `bridge._x`
    module, no underscore name of a bridge module (`bridge.diagnostics` is where the
    benchmarks and examples find the internals they report on).
(b) No file takes an underscore name out of another module of bridge/ or jaxops/:
    neither `from bridge.op import _x` nor `_run._x` on an imported module. A package's
    own private modules (`from bridge import _run` inside bridge/) are its inner
    structure, not a name taken from another module, and stay allowed.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROJECT = ("bridge", "jaxops")  # the packages whose private names are guarded
SCANNED = ("bridge", "examples", "benchmarks")


def _files():
    return sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _package_of(path: pathlib.Path) -> str:
    """The dotted package a file belongs to ("" for a script outside any package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1]) if (path.parent / "__init__.py").is_file() else ""


def _absolute(node: ast.ImportFrom, path: pathlib.Path) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(path).split(".")
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


class _Checker(ast.NodeVisitor):
    """Collects the violations of one file; `modules` maps a local name to the project
    module it was bound to by an import (per file: close enough for these modules)."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.rel = path.relative_to(ROOT).as_posix()
        self.top = self.rel.split("/")[0]
        self.modules: dict = {}
        self.problems: list = []

    def flag(self, node, what):
        self.problems.append(f"{self.rel}:{node.lineno}: {what}")

    def check_module(self, node, dotted: str):
        """An imported project module: its private parts must be this file's package."""
        parts = dotted.split(".")
        if parts[0] not in PROJECT:
            return
        hidden = [p for p in parts[1:] if _private(p)]
        if hidden and parts[0] != self.top:
            self.flag(node, f"uses {dotted}, a private module of {parts[0]}/, from outside it")

    def visit_Import(self, node):
        for alias in node.names:
            self.check_module(node, alias.name)
            if alias.name.split(".")[0] in PROJECT:
                if alias.asname:
                    self.modules[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    self.modules[top] = top
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        source = _absolute(node, self.path)
        if source.split(".")[0] not in PROJECT:
            return
        self.check_module(node, source)
        for alias in node.names:
            full = f"{source}.{alias.name}"
            if _is_module(full):
                self.check_module(node, full)
                self.modules[alias.asname or alias.name] = full
            elif _private(alias.name):
                self.flag(node, f"imports {alias.name}, a private name of {source}")

    def resolve(self, node):
        """The project module an expression names, or None."""
        if isinstance(node, ast.Name):
            return self.modules.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            if base and _is_module(f"{base}.{node.attr}"):
                return f"{base}.{node.attr}"
        return None

    def visit_Attribute(self, node):
        base = self.resolve(node.value)
        if base and _private(node.attr):
            full = f"{base}.{node.attr}"
            if _is_module(full):
                self.check_module(node, full)
            else:
                self.flag(node, f"uses {base}.{node.attr}, a private name of {base}")
        self.generic_visit(node)


def _problems(path: pathlib.Path) -> list:
    checker = _Checker(path)
    checker.visit(ast.parse(path.read_text(), filename=str(path)))
    return checker.problems


def test_the_scan_sees_the_bridge_and_its_users():
    files = {p.relative_to(ROOT).as_posix() for p in _files()}
    assert {"bridge/op.py", "bridge/linear.py", "examples/torch_ppo_loop.py",
            "benchmarks/bridge_overhead.py"} <= files


@pytest.mark.parametrize("source, expected", [
    ("from bridge import _run", []),  # inside bridge/: its own inner module
    ("from bridge.op import _check_flag", ["a private name of bridge.op"]),
    ("from bridge import _run\n_run._raw_targets", ["a private name of bridge._run"]),
    ("import bridge\nbridge._dlpack.device", []),
    ("from jaxops.staged import _helper", ["a private name of jaxops.staged"]),
    ("import jaxops.staged as st\nst._helper()", ["a private name of jaxops.staged"]),
    ("from jaxops.backends import registry\nregistry._check", ["a private name of jaxops"]),
])
def test_the_checker_catches_what_it_should(source, expected):
    path = ROOT / "bridge" / "_layout_probe.py"  # never written: parsed from `source`
    checker = _Checker(path)
    checker.visit(ast.parse(source))
    assert len(checker.problems) == len(expected), checker.problems
    for problem, want in zip(checker.problems, expected):
        assert want in problem


def test_outside_bridge_a_private_module_is_refused():
    checker = _Checker(ROOT / "examples" / "_layout_probe.py")
    checker.visit(ast.parse("import bridge\nbridge._dlpack.device(0)\n"
                            "from bridge import _windows\n"))
    assert len(checker.problems) == 2, checker.problems
    assert all("a private module of bridge/, from outside it" in p for p in checker.problems)


def test_no_private_names_cross_modules():
    problems = [p for path in _files() for p in _problems(path)]
    assert not problems, "\n".join(problems)
