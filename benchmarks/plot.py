#!/usr/bin/env python3
"""Plot a benchmark results JSON: time vs T per implementation, with the roofline.

    python -m benchmarks.plot benchmarks/results/h200.json [--out benchmarks/results/h200.png]

One panel per (phase, dtype, entropy, mask) combination measured at two or more T (at the
headline V): forward in the top row, forward+backward in the middle row (log-log axes; the
dashed black line is the roofline: bytes that must move / the copy bandwidth measured in the
same run), and forward+backward time / roofline in the bottom row with the docs/design.md §8 target.
Cases that ran out of memory are marked with an x at the top of a panel.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import os
import sys

from benchmarks import tables
from benchmarks.harness import roofline_bytes, roofline_ms

STYLE = {  # colour, marker; the Pallas backends (tables.PALLAS_ORDER) apart at a glance
    "jaxops-pallas": ("tab:pink", "*"), "jaxops-pallas_triton": ("tab:red", "o"),
    "jaxops-pallas_mosaic": ("tab:cyan", "P"), "jaxops-pallas_mosaic-u8": ("tab:blue", "P"),
    "jaxops-xla": ("tab:orange", "s"),
    "bridge": ("tab:purple", "D"), "jax-jit": ("tab:blue", "^"),
    "torch-compile": ("tab:green", "v"), "torch-eager": ("tab:olive", "<"),
    "megatron": ("tab:brown", ">"),
}


def panels(results, V):
    """Combos with at least two T values for some implementation at vocabulary V."""
    Ts = {}
    for r in results.get("rows", []):
        if r["V"] == V:
            Ts.setdefault((r["impl"], r["dtype"], r["entropy"], r["mask"]), set()).add(r["T"])
    wanted = {k[1:] for k, v in Ts.items() if len(v) >= 2}
    if not wanted:
        wanted = {k[1:] for k in Ts}
    return [c for c in tables.combos(results, None, V) if c in wanted]


def plot(results, out_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    _, V = tables.main_size(results)
    combos = panels(results, V)
    if not combos:
        raise SystemExit("no rows to plot")
    _, meta = tables.rows_run(results)  # the run the rows come from (--append)
    bw = (meta.get("bandwidth") or {}).get("used_Bps")
    fig, axes = plt.subplots(3, len(combos), figsize=(3.6 * len(combos) + 1.5, 10),
                             squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": (1, 1, 0.6)})
    handles = {}
    names = tables.labels(results)
    for col, (dtype, entropy, mask) in enumerate(combos):
        rows = [r for r in results["rows"] if (r["dtype"], r["V"], r["entropy"], r["mask"])
                == (dtype, V, entropy, mask)]
        Ts = sorted({r["T"] for r in rows})
        for row_i, (phase, title) in enumerate((("fwd", "forward"), ("fb", "forward+backward"))):
            ax = axes[row_i][col]
            if bw and Ts:
                roof = [roofline_ms(roofline_bytes(dtype, T, V, mask)[row_i], bw) for T in Ts]
                (h,) = ax.plot(Ts, roof, "k--", lw=1.5, label="roofline", zorder=5)
                handles["roofline"] = h
            oom_T = {}
            for impl in tables.IMPL_ORDER:
                pts = sorted((r["T"], r[f"{phase}_ms"]) for r in rows
                             if r["impl"] == impl and tables.ok(r, phase))
                colour, marker = STYLE.get(impl, ("gray", "."))
                if pts:
                    (h,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker,
                                   color=colour, lw=1.2, ms=5, label=names.get(impl, impl))
                    handles.setdefault(impl, h)
                for r in rows:
                    if r["impl"] == impl and r.get(f"{phase}_status") == "OOM":
                        oom_T.setdefault(r["T"], []).append(impl)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            if oom_T:
                top = ax.get_ylim()[1]
                for T, impls in oom_T.items():
                    for k, impl in enumerate(impls):
                        ax.plot([T], [top / (1.25 ** k)], "x", color=STYLE.get(impl, ("gray",))[0],
                                ms=8, mew=2)
                handles.setdefault("OOM", ax.plot([], [], "x", color="gray", ms=8, mew=2,
                                                  label="out of memory")[0])
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{title}: {tables.DT.get(dtype, dtype)}, entropy "
                         f"{tables.yn(entropy)}, mask {tables.yn(mask)}", fontsize=9)
            if col == 0:
                ax.set_ylabel("time (ms, median)")
        # Third row: forward+backward time / roofline (linear), with the docs/design.md §8 target.
        ax = axes[2][col]
        top = 1.3
        for impl in tables.IMPL_ORDER:
            pts = sorted((r["T"], r["fb_x_roof"]) for r in rows
                         if r["impl"] == impl and tables.ok(r, "fb") and r.get("fb_x_roof"))
            if pts:
                colour, marker = STYLE.get(impl, ("gray", "."))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=colour,
                        lw=1.2, ms=5)
                top = max(top, max(p[1] for p in pts))
        ax.axhline(1.0, color="k", ls="--", lw=1.5)
        handles["target"] = ax.axhline(1.2, color="gray", ls=":", lw=1.5,
                                       label="target: 1.2× roofline (fwd+bwd)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title("forward+backward ÷ roofline", fontsize=9)
        ax.set_xlabel(f"tokens T (V = {V:,})")
        if col == 0:
            ax.set_ylabel("× roofline")
        if Ts:
            ax.set_xticks(Ts)
            ax.set_xticklabels([f"{T:,}" for T in Ts], fontsize=8)
            ax.minorticks_off()
        # On a tall log axis the labels 1, 1.2 and 1.5 overlap; the target line stays drawn.
        ticks = (1, 1.2, 1.5, 2, 3, 5, 10) if top <= 10 else (1, 2, 5, 10, 20, 50, 100)
        ax.set_yticks([t for t in ticks if t <= top * 1.05])
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    dev = (results.get("device") or {}).get("name")
    commit = ((meta.get("git") or {}).get("commit") or "?")[:10]
    fig.suptitle(f"log-prob/entropy on {dev}: time vs T "
                 f"(copy bandwidth {tables.bandwidth(bw)}; commit {commit}, {meta.get('date')})"
                 if bw else f"log-prob/entropy on {dev}", fontsize=10)
    fig.legend(list(handles.values()), [h.get_label() for h in handles.values()],
               loc="lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--out", default=None, help="PNG (default: the JSON's path with .png)")
    args = parser.parse_args(argv)
    out = args.out or os.path.splitext(args.results)[0] + ".png"
    print(plot(tables.load(args.results), out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
