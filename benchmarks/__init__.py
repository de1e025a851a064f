"""Benchmarks of the log-prob/entropy op: one harness, a few entry scripts.

Run the scripts from the repository root as modules, or by path (the same):

    python -m benchmarks.bench --tiny            # python benchmarks/bench.py --tiny
    python -m benchmarks.report benchmarks/results/h200.json
    python -m benchmarks.plot benchmarks/results/h200.json

Modules: harness (roofline bytes, the timing loop, CLI and result-writing helpers),
cases (what bench measures), impls (the implementations), runner (one case: inputs,
timing, memory), bench (the CLI), report and plot (tables and the plot from the JSON),
tune, profile_kernels, gpu_smoke, bridge_overhead (kernel tuning and device checks);
host_direct, host_interleaved (the bridge's direct route: host cost); kernel_asm (the
Mosaic kernels as text, to check that a refactor changes none); mosaic_tune (the Mosaic
kernels alone over configs, or the API with uint8 / bool masks). NOTES.md is the lab
notebook.

Entry scripts run by path (`python benchmarks/bench.py`) start with the same guarded
bootstrap, the only sys.path edit here: when run that way (not with -m, not imported)
Python puts benchmarks/ rather than the repository root on sys.path, so the script puts
the root first, and `from benchmarks import harness` then finds this package.
"""
