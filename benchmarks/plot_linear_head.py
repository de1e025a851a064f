#!/usr/bin/env python3
"""Plot a fused-head results JSON (written by benchmarks/linear_head.py): forward+backward time
over the GEMM floor, and peak extra memory over the bf16 logits, per (T, H) and row.

    python -m benchmarks.plot_linear_head benchmarks/results/h200_linear_head.json \
        [MORE.json ...] [--out benchmarks/results/h200_linear_head.png]

Rows a later file measured fill in rows the first one did not (a run's time budget can
skip rows; they are then measured in a second run).

Left: forward+backward time / the faster GEMM-floor row at that shape (the four GEMMs a
recomputing fused op needs; the unfused rows run three, so they can sit below 1), with
issue 13's 1.15x target. Right: peak extra memory of forward+backward / the bf16 logits'
bytes (T * V * 2), log scale, with the 1/8 target. Rows with entropy where they have the
choice; Liger computes CE only (no entropy). The bridge's rows whose JAX side is only a
lower bound (linear_head.py's "*") are hatched, or marked "n/m" where that bound is ~0.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import os

ROWS = (  # (impl, entropy) in bar order
    ("jaxops-fused", True), ("bridge-fused", True), ("jax-unfused", True),
    ("torch-bridge", True), ("torch-compile", True), ("liger", False), ("verl", True))
FLOORS = ("gemm-jax", "gemm-torch")
COLOURS = ("tab:red", "tab:purple", "tab:orange", "tab:brown", "tab:green", "tab:gray",
           "tab:blue")


def _row(rows, impl, entropy, T, H):
    for r in rows:
        if (r["impl"], r["T"], r["H"]) == (impl, T, H) and (
                r.get("entropy") in (entropy, None) or impl in ("liger", "verl")):
            return r
    return None


def plot(results, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r.get("status") == "ok"]
    shapes = sorted({(r["T"], r["H"]) for r in rows}, key=lambda s: (s[1], s[0]))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5.6))
    width = 0.8 / len(ROWS)
    for k, ((impl, entropy), colour) in enumerate(zip(ROWS, COLOURS)):
        xs, times, mems, hatched = [], [], [], []
        for i, (T, H) in enumerate(shapes):
            r = _row(rows, impl, entropy, T, H)
            floors = [f["fb_ms"] for f in rows
                      if f["impl"] in FLOORS and (f["T"], f["H"]) == (T, H) and f.get("fb_ms")]
            if r is None or not r.get("fb_ms") or not floors:
                continue
            xs.append(i + (k - (len(ROWS) - 1) / 2) * width)
            times.append(r["fb_ms"] / min(floors))
            mems.append(max(r.get("fb_extra_bytes", 0), 1) / (T * results["V"] * 2))
            hatched.append(r.get("framework") == "torch" and "bridge" in impl
                           and not r.get("fb_jax_side_exact", True))
        if not xs:
            continue
        label = next((r["label"] for r in rows if r["impl"] == impl), impl)
        ax_t.bar(xs, times, width, color=colour, label=label)
        bars = ax_m.bar(xs, mems, width, color=colour)
        for bar, h in zip(bars, hatched):
            if h:  # a lower bound; near zero it says nothing, so no bar
                bar.set_hatch("//")
                if bar.get_height() < 1e-3:
                    bar.set_visible(False)
                    ax_m.text(bar.get_x() + width / 2, 2e-3, "n/m", rotation=90,
                              ha="center", va="bottom", fontsize=7, color=colour)
    names = [f"T={T:,}\nH={H:,}" for T, H in shapes]
    for ax in (ax_t, ax_m):
        ax.set_xticks(range(len(shapes)), names)
        ax.grid(axis="y", alpha=0.3)
    ax_t.axhline(1.0, color="k", lw=1)
    ax_t.axhline(1.15, color="k", ls=":", lw=1, label="target 1.15x")
    ax_t.set_ylabel("forward+backward / GEMM floor (4 GEMMs)")
    ax_m.axhline(1 / 8, color="k", ls=":", lw=1)
    ax_m.set_yscale("log")
    ax_m.set_ylim(1e-3, 20)
    ax_m.set_ylabel("peak extra memory / bf16 logits (target 1/8, dotted)")
    fig.legend(*ax_t.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=4)
    git = (results.get("git") or {}).get("commit", "")[:7] if isinstance(results.get("git"), dict) \
        else str(results.get("git", ""))[:7]
    fig.suptitle(f"LM head + log-prob/entropy on {results.get('device', '?')}, bf16, "
                 f"V = {results['V']:,} (commit {git}, {results.get('date', '')})", fontsize=10)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(out, dpi=110)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", default=None, help="PNG (default: the first JSON's name, .png)")
    args = parser.parse_args(argv)
    with open(args.results[0]) as f:
        results = json.load(f)
    for path in args.results[1:]:
        with open(path) as f:
            more = json.load(f)
        have = {(r["impl"], r["T"], r["H"], r.get("entropy")) for r in results["rows"]
                if r.get("status") == "ok"}
        results["rows"] = [r for r in results["rows"] if r.get("status") == "ok"] + [
            r for r in more["rows"]
            if r.get("status") == "ok" and (r["impl"], r["T"], r["H"], r.get("entropy")) not in have]
    out = args.out or os.path.splitext(args.results[0])[0] + ".png"
    print(f"wrote {plot(results, out)}")


if __name__ == "__main__":
    main()
