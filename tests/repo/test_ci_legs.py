"""The JAX range pyproject.toml claims is the range CI tests (issue 39): the oldest and
the newest allowed minor each have a test leg of `./run test` pinning them, so moving
a bound without a leg fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def claimed_jax_range() -> tuple[tuple[int, int], tuple[int, int]]:
    """((oldest minor), (newest minor)) of pyproject.toml's `jax>=A.B,<C.D`, the same in
    every requirement that names jax (the CUDA extras repeat it)."""
    text = (ROOT / "pyproject.toml").read_text()
    specs = set(re.findall(r'"jax(?:\[\w+\])?(>=[^"]*)"', text))
    assert len(specs) == 1, f"pyproject.toml's jax requirements disagree: {specs}"
    match = re.fullmatch(r">=(\d+)\.(\d+),<(\d+)\.(\d+)", specs.pop())
    assert match, "expected jax>=A.B,<C.D in pyproject.toml"
    lo_major, lo_minor, hi_major, hi_minor = map(int, match.groups())
    assert hi_major == lo_major and hi_minor > lo_minor, match.group(0)
    return (lo_major, lo_minor), (hi_major, hi_minor - 1)


def pinned_legs() -> dict[str, tuple[int, int, int]]:
    """{requirements file: its jax pin} for every requirements file `./run` uses."""
    run = (ROOT / "run").read_text()
    legs = {}
    for path in sorted((ROOT / "requirements").glob("*.txt")):
        name = f"requirements/{path.name}"
        if name not in run:
            continue
        text = path.read_text()
        pin = re.search(r"^jax==(\d+\.\d+\.\d+)\s*$", text, re.M)
        assert pin, f"{name}: no jax==X.Y.Z pin"
        assert re.search(rf"^jaxlib=={re.escape(pin[1])}\s*$", text, re.M), \
            f"{name}: jaxlib must be pinned to jax's version, {pin[1]}"
        legs[name] = tuple(map(int, pin[1].split(".")))
    return legs


def test_both_ends_of_the_jax_range_have_a_ci_leg():
    oldest, newest = claimed_jax_range()
    pinned = {pin[:2] for pin in pinned_legs().values()}
    assert oldest in pinned, f"jax {oldest} (pyproject's lower bound) has no pinned CI leg"
    assert newest in pinned, (
        f"jax {newest[0]}.{newest[1]} is the newest minor pyproject.toml allows, but no "
        f"requirements file of ./run test pins it (pins: {sorted(pinned)}): add a leg "
        "before moving the upper bound")


def test_every_pin_is_within_the_claimed_range():
    oldest, newest = claimed_jax_range()
    for name, pin in pinned_legs().items():
        assert oldest <= pin[:2] <= newest, f"{name} pins jax {pin}, outside the range"
