"""The results JSON bench.py writes: its metadata (device, versions, settings, method) and
`--append`, which adds a run to an earlier run's file. report.py and plot.py read it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

from benchmarks.cases import LOGIT_SCALE, MASK_DENSITY
from benchmarks.harness import REPO, git_info, package_version

SCHEMA = 1
RUN_KEYS = ("date", "git", "versions", "command", "mode", "env", "settings", "bandwidth")


def describe(args, mode, filters, torch, jax, gpu_name, device_name, jax_mem_keys, argv):
    """The results file before any row: device, versions, settings, method."""
    return {
        "schema": SCHEMA,
        "device_name": device_name,
        "device": {
            "name": gpu_name,
            "jax_device": str(jax.devices()[0]),
            "jax_device_kind": getattr(jax.devices()[0], "device_kind", None),
            "platform": jax.default_backend(),
            "total_memory_bytes": (torch.cuda.get_device_properties(0).total_memory
                                   if args.on_gpu else None),
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git_info(),
        "versions": {
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": package_version("jaxlib"), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "triton": package_version("triton"),
            "megatron_core": package_version("megatron-core") or package_version("megatron_core"),
            "numpy": package_version("numpy"),
        },
        "command": [os.path.relpath(sys.argv[0], REPO) if sys.argv and sys.argv[0] else ""]
                   + list(sys.argv[1:] if argv is None else argv),
        "mode": mode,
        "env": {k: os.environ.get(k) for k in (
            "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_FLAGS", "PYTORCH_CUDA_ALLOC_CONF")},
        "settings": {
            "reps": args.reps, "target_ms": args.target_ms, "max_calls": args.max_calls,
            "max_input_gb": args.max_input_gb, "budget_s": args.budget_s,
            "temperature": args.temperature, "mask_density": MASK_DENSITY,
            "logits": f"N(0, {LOGIT_SCALE}^2) in the logits' dtype",
            "pallas_config": str(args.pallas_config),
            "mosaic_config": str(args.mosaic_config),
            "bool_mask_view": args.bool_mask_view,
            "bridge_kwargs": args.bridge_kwargs,
            "megatron_jit_fuser": ("torch.compile (Megatron's default)" if args.on_gpu
                                   else "disabled (CPU smoke run)"),
            "filters": {k: v for k, v in filters.items()},
        },
        "method": {
            "roofline": "bytes / max(measured copy bandwidths); fwd = T*V*itemsize (+T*V "
                        "mask), fwd+bwd = 3*T*V*itemsize (+2*T*V mask)",
            "timing": "median over reps of (loop of N calls on rotating fresh random input "
                      "sets, then one sync) / N. JAX: block_until_ready, wall clock; torch: "
                      "CUDA events around the loop; bridge: wall clock + "
                      "torch.cuda.synchronize()",
            "forward": "inference forward (torch.no_grad; the jitted function alone)",
            "torch.compile": "torch.compile(fullgraph=True), default mode; T marked dynamic "
                             "(mark_dynamic), V static (mark_static)",
            "fwd+bwd": "outputs + gradient for random cotangents (jax.vjp in one jit; "
                       "torch.autograd.grad); megatron includes the clone",
            "memory": "peak extra bytes of one call over what was live (inputs): torch "
                      "max_memory_allocated delta; JAX compiled memory_analysis temp+output-"
                      "alias (runtime memory_stats delta in *_runtime_extra_bytes, only "
                      "meaningful when the process peak rose); bridge: torch delta + JAX "
                      "bytes_in_use/peak delta",
            "jax_memory_stats_keys": sorted(jax_mem_keys),
        },
        "bandwidth": None,
        "rows": [],
        "complete": False,
    }


def merge_previous(results, out_path, device_name, cases, run_meta):
    """--append: add this run to an earlier run's file (rows re-measured here replace the
    old ones). The top-level metadata stays the first run's; every row names its run and
    carries the bandwidth its roofline used, so each number stays traceable. Returns the
    previous rows of the cases this run measures again."""
    with open(out_path) as f:
        prev = json.load(f)
    if prev.get("device_name") != device_name:
        raise SystemExit(f"--append: {out_path} is for {prev.get('device_name')!r}, "
                         f"not {device_name!r}")
    keys = {c.key for c in cases}
    old_runs = prev.get("runs") or [{k: prev.get(k) for k in run_meta}]
    for k in RUN_KEYS + ("device", "method"):
        results[k] = prev.get(k, results[k])
    results["runs"] = old_runs + [run_meta]
    results["rows"] = []
    earlier = {}
    for r in prev.get("rows", []):
        key = (r["impl"], r["dtype"], r["T"], r["V"], r["entropy"], r["mask"])
        if key in keys:
            earlier[key] = r
        else:
            results["rows"].append(r)
    print(f"[bench] appending run {len(old_runs)} to {out_path} "
          f"({len(results['rows'])} earlier rows kept)", flush=True)
    return earlier


def keep_measured(row, old, run_index):
    """--append: a case that this run skipped (time budget, a package missing on the device)
    keeps its earlier measured row rather than losing it, with a note saying so."""
    if old is None or old.get("status") != "ok" or not str(row.get("status")).startswith("skipped"):
        return row
    old = dict(old)
    old["note"] = f"kept from run {old.get('run', 0)}: run {run_index} was {row['status']}"
    print(f"[bench] {row['impl']} {row['dtype']} T={row['T']} V={row['V']}: {old['note']}",
          flush=True)
    return old
