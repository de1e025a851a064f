#!/usr/bin/env python3
"""Tables from a benchmark results JSON (written by bench.py): text, and the docs' markdown.

    python -m benchmarks.report benchmarks/results/h200.json                   # print markdown
    python -m benchmarks.report benchmarks/results/h200.json --update-readme   # write the docs

`--update-readme` replaces, in each of README.md and docs/performance.md (`--readme`,
`--performance`), what lies between `<!-- perf-summary:start -->` and
`<!-- perf-summary:end -->` with the short table (`summary_md`) and what lies between
`<!-- perf-table:start -->` and `<!-- perf-table:end -->` with the full tables
(`markdown`), where a file has those markers; every number there comes from the JSON.
Links are relative to the file's folder.

This module builds the markdown and edits the docs; the lookups over the rows, the cell
formats and the plain-text tables (`--text`) are in tables.py.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import os
import sys

from benchmarks.harness import REPO
from benchmarks.tables import (ANCHOR_ORDER, DT, IMPL_ORDER, bandwidth, beyond_grad, combos,
                               gb, labels, load, main_size, ms, ok, ours, pallas_impls,
                               phase_cell, ratio, rows_by_key, rows_run, size, text_speedups,
                               text_table, x_roof, yn)

START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
SUMMARY_START, SUMMARY_END = "<!-- perf-summary:start -->", "<!-- perf-summary:end -->"
# The anchors of the short table (summary_md), where measured.
SUMMARY_ANCHORS = ("jax-jit", "torch-compile", "megatron")


# ---------------------------------------------------------------------------- markdown


def _md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _pair(a, b):
    return f"{a} ({b})"


def headline_md(results):
    T, V = main_size(results)
    index = rows_by_key(results)
    kernels = pallas_impls(results)  # time and x roofline of each backend, side by side
    present = [a for a in ANCHOR_ORDER if any(k[0] == a and k[2] == T and k[3] == V
                                              for k in index)]
    header = ["dtype", "entropy", "mask", "roofline ms"]
    for impl in kernels:
        header += [f"{labels(results)[impl]} ms", "× roofline"]
    header += [("bridge overhead µs" if a == "bridge" else f"vs {labels(results)[a]}")
               for a in present]
    rows = []
    for dtype, entropy, mask in combos(results, T, V):
        ours = index.get((kernels[0], dtype, T, V, entropy, mask))
        if ours is None:
            continue
        cells = [DT.get(dtype, dtype), yn(entropy), yn(mask),
                 _pair(ms(ours.get("fb_roof_ms")), ms(ours.get("fwd_roof_ms")))]
        for impl in kernels:
            row = index.get((impl, dtype, T, V, entropy, mask))
            cells += [_pair(phase_cell(row, "fb"), phase_cell(row, "fwd")),
                      _pair(x_roof(row, "fb"), x_roof(row, "fwd"))]
        for anchor in present:
            row = index.get((anchor, dtype, T, V, entropy, mask))
            if row is None:
                cells.append("—")
                continue
            vals = []
            for phase in ("fb", "fwd"):
                if ok(row, phase) and ok(ours, phase):
                    if anchor == "bridge":
                        vals.append(f"{(row[f'{phase}_ms'] - ours[f'{phase}_ms']) * 1e3:+.0f}")
                    else:
                        vals.append(ratio(row[f"{phase}_ms"] / ours[f"{phase}_ms"]))
                else:
                    vals.append(phase_cell(row, phase))
            mixed = row.get("run", 0) != ours.get("run", 0)
            cells.append("n/a" if vals == ["n/a", "n/a"] else _pair(*vals) + (" †" if mixed else ""))
        rows.append(cells)
    table = _md_table(header, rows)
    if any("†" in c for row in rows for c in row):
        table += ("\n\n† from different runs of bench.py (`--append`); all other comparisons "
                  "are within one run.")
    return table


def all_rows_md(results, T, V):
    index = rows_by_key(results)
    header = ["implementation", "dtype", "entropy", "mask", "fwd ms", "× roofline",
              "fwd+bwd ms", "× roofline", "peak extra fwd+bwd GB", "beyond the gradient"]
    rows = []
    for dtype, entropy, mask in combos(results, T, V):
        rows.append([f"*roofline*", DT.get(dtype, dtype), yn(entropy), yn(mask),
                     *_roof_cells(results, dtype, T, V, mask), "", ""])
        for impl in IMPL_ORDER:
            r = index.get((impl, dtype, T, V, entropy, mask))
            if r is None or (r.get("status", "").startswith("n/a")):
                continue
            extra = beyond_grad(r)
            rows.append([labels(results)[impl], DT.get(dtype, dtype), yn(entropy), yn(mask),
                         phase_cell(r, "fwd"), x_roof(r, "fwd"), phase_cell(r, "fb"),
                         x_roof(r, "fb"), gb(r.get("fb_peak_extra_bytes")) if ok(r, "fb") else "—",
                         size(extra)])
    return _md_table(header, rows)


def _roof_cells(results, dtype, T, V, mask):
    for r in results.get("rows", []):
        if (r["dtype"], r["T"], r["V"], r["mask"]) == (dtype, T, V, mask) and "fb_roof_ms" in r:
            return [ms(r["fwd_roof_ms"]), "1.00×", ms(r["fb_roof_ms"]), "1.00×"]
    return ["—", "", "—", ""]


def sweep_md(results):
    """fwd+bwd (fwd) ms per implementation vs T, at the headline V, combos without a mask."""
    _, V = main_size(results)
    index = rows_by_key(results)
    primary = ours(results)
    Ts = sorted({r["T"] for r in results.get("rows", []) if r["V"] == V})
    if len(Ts) < 2:
        return None
    header = ["implementation", "dtype", "entropy"] + [f"T = {T:,}" for T in Ts]
    rows = []
    for dtype, entropy, mask in combos(results, None, V):
        if mask or sum((primary, dtype, T, V, entropy, mask) in index for T in Ts) < 2:
            continue
        roof = []
        for T in Ts:
            r = index.get((primary, dtype, T, V, entropy, mask))
            roof.append(_pair(ms(r["fb_roof_ms"]), ms(r["fwd_roof_ms"])) if r and "fb_roof_ms" in r
                        else "—")
        rows.append(["*roofline*", DT.get(dtype, dtype), yn(entropy), *roof])
        for impl in IMPL_ORDER:
            cells = []
            for T in Ts:
                r = index.get((impl, dtype, T, V, entropy, mask))
                if r is None:
                    cells.append("—")
                elif ok(r, "fb") and ok(r, "fwd"):
                    cells.append(f"{ms(r['fb_ms'])} ({ms(r['fwd_ms'])}), "
                                 f"{ratio(r['fb_x_roof'])}")
                else:
                    cells.append(_pair(phase_cell(r, "fb"), phase_cell(r, "fwd")))
            if any(c not in ("—", "n/a (n/a)") for c in cells):
                rows.append([labels(results)[impl], DT.get(dtype, dtype), yn(entropy), *cells])
    return _md_table(header, rows)


def memory_summary(results):
    """One sentence per Pallas backend measured; None if none has a measured row."""
    lines = []
    for impl in pallas_impls(results):
        rows = [r for r in results.get("rows", [])
                if r["impl"] == impl and beyond_grad(r) is not None]
        if not rows:
            continue
        worst = max(rows, key=beyond_grad)
        lines.append(
            f"Memory: for {labels(results)[impl]} the peak extra allocation of forward+backward "
            "is the "
            f"gradient plus at most {beyond_grad(worst) / 1e6:.2f} MB over all "
            f"{len(rows)} cases (worst: {DT.get(worst['dtype'])}, T = {worst['T']:,}, "
            f"V = {worst['V']:,}, entropy {yn(worst['entropy'])}, mask {yn(worst['mask'])}; "
            f"{beyond_grad(worst) / worst['T']:.0f} bytes per token), measured as "
            f"`{worst.get('mem_method')}`.")
    return "\n\n".join(lines) or None


def _rel(path, base):
    return os.path.relpath(path, base).replace(os.sep, "/")


def summary_md(results, json_path=None, base=REPO):
    """The short table: per case at the headline size, the roofline, the default Pallas
    implementation's time and x roofline, and its speed-up over a few anchors."""
    T, V = main_size(results)
    index = rows_by_key(results)
    primary = ours(results)
    present = [a for a in SUMMARY_ANCHORS if any(k[0] == a and k[2] == T and k[3] == V
                                                 for k in index)]
    header = ["dtype", "entropy", "mask", "roofline ms", f"{labels(results)[primary]} ms",
              "× roofline"]
    header += [f"vs {labels(results)[a]}" for a in present]
    rows = []
    for dtype, entropy, mask in combos(results, T, V):
        row = index.get((primary, dtype, T, V, entropy, mask))
        if row is None:
            continue
        cells = [DT.get(dtype, dtype), yn(entropy), yn(mask),
                 _pair(ms(row.get("fb_roof_ms")), ms(row.get("fwd_roof_ms"))),
                 _pair(phase_cell(row, "fb"), phase_cell(row, "fwd")),
                 _pair(x_roof(row, "fb"), x_roof(row, "fwd"))]
        for anchor in present:
            other = index.get((anchor, dtype, T, V, entropy, mask))
            vals = [ratio(other[f"{p}_ms"] / row[f"{p}_ms"]) if other is not None
                    and ok(other, p) and ok(row, p) else phase_cell(other, p)
                    for p in ("fb", "fwd")]
            cells.append("n/a" if vals == ["n/a", "n/a"] or other is None else _pair(*vals))
        rows.append(cells)
    _, meta = rows_run(results)
    src = f" ([`{_rel(json_path, base)}`]({_rel(json_path, base)}))" if json_path else ""
    return (f"**{(results.get('device') or {}).get('name')}**, T = {T:,}, V = {V:,}, "
            f"{meta.get('date')}{src}; cells are forward+backward (forward):\n\n"
            + _md_table(header, rows) + "\n")


def markdown(results, json_path=None, png_path=None, base=REPO):
    T, V = main_size(results)
    runs = results.get("runs") or []
    row_runs, meta = rows_run(results)
    bw = meta.get("bandwidth") or {}
    used = bw.get("used_Bps")
    parts = {k[:-4]: v for k, v in bw.items() if k.endswith("_Bps") and k != "used_Bps"}
    git = meta.get("git") or {}
    commit = (git.get("commit") or "unknown")[:10] + (" (dirty)" if git.get("dirty") else "")
    versions = meta.get("versions") or {}
    rel = (lambda p: _rel(p, base)) if json_path else None
    src = f"[`{rel(json_path)}`]({rel(json_path)})" if json_path else "the results JSON"
    plot = f" Plot: [`{rel(png_path)}`]({rel(png_path)})." if png_path else ""
    runs_note = ""
    if meta is not results:
        runs_note = (f" Every row is from run {row_runs[0]} of the {len(runs)} runs in the file "
                     f"(`--append`; the earlier runs' rows were all measured again).")
        which = f"run {row_runs[0]}"
    elif len(runs) > 1:
        which = "the first of several runs"
        runs_note = (f" The file holds {len(runs)} runs (`--append`): "
                     + "; ".join(f"run {i}: {r.get('date')}, commit "
                                 f"`{((r.get('git') or {}).get('commit') or '?')[:10]}`, copy "
                                 f"bandwidth {bandwidth((r.get('bandwidth') or {}).get('used_Bps', 0))}"
                                 for i, r in enumerate(runs))
                     + "; each row's roofline uses its own run's bandwidth.")
    else:
        which = "one run"
    lines = [
        "<!-- generated by benchmarks/report.py from the results JSON; do not edit by hand -->",
        f"Measured on **{(results.get('device') or {}).get('name')}** in {which} of "
        f"`{' '.join(meta.get('command') or ['benchmarks/bench.py'])}` "
        f"({meta.get('mode')} mode{'' if results.get('complete') else ', INCOMPLETE run'}): "
        f"{src}, commit `{commit}`, {meta.get('date')}, jax {versions.get('jax')}, "
        f"torch {versions.get('torch')}, triton {versions.get('triton')}, megatron-core "
        f"{versions.get('megatron_core')}.{plot}{runs_note}",
        "",
        f"Copy bandwidth measured in the same run (bytes read + written): "
        + ", ".join(f"{k.replace('_', ' ')} {bandwidth(v)}" for k, v in parts.items())
        + (f"; the roofline uses the largest, {bandwidth(used)}. " if used else ". ")
        + "Roofline = bytes that must move / that bandwidth: forward reads the logits once "
        "(+ the bool mask), forward+backward moves them three times (+ two reads of the mask). "
        "Times are medians of many device-synchronised calls on fresh random logits; "
        "forward is an inference forward, forward+backward returns the gradient for random "
        f"cotangents; speed-up = anchor time / {labels(results)[ours(results)]} time, both "
        "from this run.",
        "",
        f"**T = {T:,}, V = {V:,}** — cells are forward+backward (forward):",
        "",
        headline_md(results),
        "",
    ]
    mem = memory_summary(results)
    if mem:
        lines += [mem, ""]
    lines += ["<details><summary>All implementations at this size (times in ms, peak extra "
              "memory of forward+backward)</summary>", "", all_rows_md(results, T, V), "",
              "</details>", ""]
    others = sorted({(r["T"], r["V"]) for r in results.get("rows", [])} - {(T, V)})
    for T2, V2 in others:
        if V2 != V:
            lines += [f"<details><summary>T = {T2:,}, V = {V2:,} (one vocabulary shard of "
                      f"tensor parallelism {V // V2 if V2 and V % V2 == 0 else '?'})</summary>",
                      "", all_rows_md(results, T2, V2), "", "</details>", ""]
    sweep = sweep_md(results)
    if sweep:
        lines += [f"<details><summary>Scaling with T at V = {V:,}: forward+backward "
                  "(forward) ms, × roofline of forward+backward</summary>", "", sweep, "",
                  "</details>", ""]
    return "\n".join(lines).rstrip() + "\n"


def _replace(text, start, end, md):
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + "\n" + md + end + tail


def update_readme(readme_path, md, summary=None):
    """Writes `md` between the perf-table markers and `summary` between the perf-summary
    markers of the file, where it has them (at least one pair)."""
    with open(readme_path) as f:
        text = f.read()
    found = False
    if START in text and END in text:
        text, found = _replace(text, START, END, md), True
    if summary is not None and SUMMARY_START in text and SUMMARY_END in text:
        text, found = _replace(text, SUMMARY_START, SUMMARY_END, summary), True
    if not found:
        raise SystemExit(f"{readme_path}: markers {START} / {END} or {SUMMARY_START} / "
                         f"{SUMMARY_END} not found")
    with open(readme_path, "w") as f:
        f.write(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="results JSON written by bench.py")
    parser.add_argument("--update-readme", action="store_true",
                        help="write the markdown between the perf-table markers of --readme")
    parser.add_argument("--readme", default=os.path.join(REPO, "README.md"))
    parser.add_argument("--performance", default=os.path.join(REPO, "docs", "performance.md"))
    parser.add_argument("--png", default=None,
                        help="plot to link (default: the JSON's path with .png, if it exists)")
    parser.add_argument("--text", action="store_true", help="print the plain-text tables")
    args = parser.parse_args(argv)
    results = load(args.results)
    png = args.png or os.path.splitext(args.results)[0] + ".png"
    png = png if os.path.exists(png) else None
    if args.text:
        print(text_table(results))
        print()
        print(text_speedups(results))
        return 0
    json_path, png = os.path.abspath(args.results), png and os.path.abspath(png)
    if args.update_readme:
        for path in (args.readme, args.performance):
            if not os.path.exists(path):
                continue
            base = os.path.dirname(os.path.abspath(path))
            update_readme(path, markdown(results, json_path, png, base),
                          summary_md(results, json_path, base))
            print(f"updated {path}")
    else:
        print(markdown(results, json_path, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
