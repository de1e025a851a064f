"""What a benchmark results JSON (written by bench.py) says, and how it reads in a table.

Lookups over the rows (by case key, the headline size, the dtype / entropy / mask combos,
the Pallas backends measured and the one speed-ups divide by, the run the rows come from),
the speed-ups, the display names, the number formats of a table cell, and bench.py's
plain-text tables. report.py builds the docs' markdown from these, plot.py its figure.
"""

from __future__ import annotations

import json

# The op's Pallas kernels, in the order that picks the headline ("ours": speed-ups are
# anchor time / its time): "pallas" where measured (the default callers get: bench.py's
# default set has it since "pallas" became the Mosaic kernels on Hopper), else the Triton
# backend, else Mosaic (older results files). The other backends present get their own time
# and x roofline columns, and count as anchors in `speedups`.
PALLAS_ORDER = ("jaxops-pallas", "jaxops-pallas_triton", "jaxops-pallas_mosaic",
                "jaxops-pallas_mosaic-u8")
OURS = PALLAS_ORDER[0]  # where no row names a Pallas backend
ANCHOR_ORDER = ("jaxops-xla", "bridge", "jax-jit", "torch-compile", "torch-eager", "megatron")
IMPL_ORDER = PALLAS_ORDER + ANCHOR_ORDER
LABEL = {"jaxops-pallas": "jaxops (Pallas)", "jaxops-pallas_triton": "jaxops (Pallas Triton)",
         "jaxops-pallas_mosaic": "jaxops (Pallas Mosaic)",
         "jaxops-pallas_mosaic-u8": "jaxops (Pallas Mosaic, uint8 mask)",
         "jaxops-xla": "jaxops (XLA)",
         "bridge": "bridge (torch → jaxops)", "jax-jit": "jax.jit", "torch-compile": "torch.compile",
         "torch-eager": "torch eager", "megatron": "Megatron fused CE"}
# The headline name of the row a results file marks as the default (bench.py writes
# "default_impl": "jaxops-pallas"). Files written before that (e.g. the committed h200.json,
# where "jaxops-pallas" was an alias run by --filter under an older policy) keep LABEL's
# names, so their tables render as they always did.
DEFAULT_LABEL = "jaxops (default)"


def labels(results):
    """LABEL, with the results' default implementation (if it names one) as DEFAULT_LABEL."""
    default = (results or {}).get("default_impl")
    if default in LABEL:
        return {**LABEL, default: DEFAULT_LABEL}
    return LABEL


DT = {"float32": "fp32", "bfloat16": "bf16"}


# ---------------------------------------------------------------------------- access


def load(path):
    with open(path) as f:
        return json.load(f)


def ok(row, phase):
    return row.get(f"{phase}_status") == "ok" and row.get(f"{phase}_ms") is not None


def rows_by_key(results):
    return {(r["impl"], r["dtype"], r["T"], r["V"], r["entropy"], r["mask"]): r
            for r in results.get("rows", [])}


HEADLINE = (8192, 151_936)  # docs/design.md §7/§8


def main_size(results):
    """(T, V) of the headline comparison: the design's headline size if measured, else the first one."""
    rows = results.get("rows", [])
    if any((r["T"], r["V"]) == HEADLINE for r in rows):
        return HEADLINE
    return (rows[0]["T"], rows[0]["V"]) if rows else (None, None)


def combos(results, T=None, V=None):
    seen = []
    for r in results.get("rows", []):
        if (T is None or r["T"] == T) and (V is None or r["V"] == V):
            combo = (r["dtype"], r["entropy"], r["mask"])
            if combo not in seen:
                seen.append(combo)
    order = {"float32": 0, "bfloat16": 1}
    return sorted(seen, key=lambda c: (order.get(c[0], 9), c[1], c[2]))


def pallas_impls(results):
    """The Pallas implementations the rows measure, in PALLAS_ORDER; [OURS] if none."""
    seen = {r["impl"] for r in results.get("rows", [])}
    return [i for i in PALLAS_ORDER if i in seen] or [OURS]


def ours(results):
    """The implementation the speed-ups divide by (PALLAS_ORDER's first measured)."""
    return pallas_impls(results)[0]


def speedups(results):
    """Anchor time / ours(results) time at the headline size, per combo, anchor and
    phase; the other Pallas backends are anchors too (Mosaic time / Triton time)."""
    T, V = main_size(results)
    index = rows_by_key(results)
    primary = ours(results)
    anchors = [i for i in pallas_impls(results) if i != primary] + list(ANCHOR_ORDER)
    out = []
    for dtype, entropy, mask in combos(results, T, V):
        ours_row = index.get((primary, dtype, T, V, entropy, mask))
        if ours_row is None:
            continue
        for anchor in anchors:
            row = index.get((anchor, dtype, T, V, entropy, mask))
            if row is None:
                continue
            entry = {"anchor": anchor, "ours": primary, "dtype": dtype, "T": T, "V": V,
                     "entropy": entropy, "mask": mask}
            for phase in ("fwd", "fb"):
                good = ok(row, phase) and ok(ours_row, phase)
                entry[phase] = row[f"{phase}_ms"] / ours_row[f"{phase}_ms"] if good else None
                entry[f"{phase}_delta_us"] = (
                    (row[f"{phase}_ms"] - ours_row[f"{phase}_ms"]) * 1e3 if good else None)
            entry["same_run"] = row.get("run", 0) == ours_row.get("run", 0)
            if entry["fwd"] is None and entry["fb"] is None:
                entry["status"] = row.get("status")
            out.append(entry)
    return out



def rows_run(results):
    """(sorted run indices of the rows, metadata to describe them): with `--append` the
    rows may all come from a later run than the file's first, whose top-level metadata
    would then describe none of them."""
    runs = results.get("runs") or []
    row_runs = sorted({r.get("run", 0) for r in results.get("rows", [])})
    if len(row_runs) == 1 and len(runs) > 1 and row_runs[0] < len(runs):
        return row_runs, {**results, **runs[row_runs[0]]}
    return row_runs, results


# ---------------------------------------------------------------------------- formatting


def ms(value):
    if value is None:
        return "—"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def bandwidth(bps):
    return f"{bps / 1e12:.2f} TB/s" if bps >= 1e11 else f"{bps / 1e9:.2f} GB/s"


def ratio(value, suffix="×"):
    return "—" if value is None else f"{value:.2f}{suffix}"


def gb(value):
    return "—" if value is None else f"{value / 1e9:.2f}"


def size(nbytes):
    if nbytes is None:
        return "—"
    return f"{nbytes / 1e9:.2f} GB" if abs(nbytes) >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def yn(flag):
    return "yes" if flag else "no"


def phase_cell(row, phase):
    """'1.23' or the reason there is no number ('OOM', 'n/a', ...)."""
    if row is None:
        return "—"
    if ok(row, phase):
        return ms(row[f"{phase}_ms"])
    status = row.get(f"{phase}_status") or row.get("status") or "?"
    if status.startswith("n/a"):
        return "n/a"
    if status.startswith("skipped"):
        return "skipped"
    if status == "OOM":
        return "OOM"
    return "error"


def x_roof(row, phase):
    return ratio(row.get(f"{phase}_x_roof")) if row is not None and ok(row, phase) else "—"


def beyond_grad(row):
    extra = row.get("fb_peak_extra_bytes")
    return None if extra is None or not ok(row, "fb") else extra - row["grad_bytes"]


def text_table(results):
    head = (f"{'implementation':20s} {'dtype':8s} {'T':>6s} {'V':>7s} {'H':1s} {'M':1s} "
            f"{'fwd ms':>9s} {'x roof':>7s} {'fb ms':>9s} {'x roof':>7s} {'peak GB':>8s}  status")
    lines = [head, "-" * len(head)]
    for r in results.get("rows", []):
        lines.append(
            f"{r['impl']:20s} {r['dtype']:8s} {r['T']:6d} {r['V']:7d} "
            f"{'H' if r['entropy'] else '-'} {'M' if r['mask'] else '-'} "
            f"{phase_cell(r, 'fwd'):>9s} {x_roof(r, 'fwd'):>7s} "
            f"{phase_cell(r, 'fb'):>9s} {x_roof(r, 'fb'):>7s} "
            f"{gb(r.get('fb_peak_extra_bytes')) if ok(r, 'fb') else '—':>8s}  "
            f"{'' if r.get('status') == 'ok' else r.get('status', '')}")
    return "\n".join(lines)


def text_speedups(results):
    T, V = main_size(results)
    primary = ours(results)
    lines = [f"speed-up of {primary} over each anchor at T={T}, V={V} "
             f"(anchor time / {primary} time; fwd | fwd+bwd):"]
    for e in results.get("speedups") or speedups(results):
        lines.append(f"  {DT.get(e['dtype'], e['dtype']):4s} entropy={yn(e['entropy']):3s} "
                     f"mask={yn(e['mask']):3s} vs {e['anchor']:20s} "
                     f"{ratio(e['fwd']):>8s} | {ratio(e['fb']):>8s}"
                     + (f"  ({e['status']})" if e.get("status") else ""))
    return "\n".join(lines)
