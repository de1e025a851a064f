"""Benchmarks of the log-prob/entropy op: one harness, a few entry scripts.

Run the scripts from the repository root as modules, or by path (the same):

    python -m benchmarks.bench --tiny            # python benchmarks/bench.py --tiny
    python -m benchmarks.report benchmarks/results/h200.json
    python -m benchmarks.plot benchmarks/results/h200.json

Modules: harness (roofline bytes, the timing loop, CLI and result-writing helpers), cases
(what bench measures), impls (the implementations), inputs (a case's random inputs),
runner (one case: timing, memory), results_json (the results file's metadata, --append),
bench (the CLI), tables (lookups over the JSON's rows, cell formats, the text tables),
report and plot (the docs' markdown and the plot from the JSON), linear_head and
plot_linear_head (the fused output layer; its rows in linear_head_impls, one row's
measurement in linear_head_runner), bridge_overhead (the bridge's host cost), gpu_tests.sh
(every GPU test file). Developer tools are in benchmarks/tools/ (kernel tuning and
profiling, the backend-choice measurements, kernel_asm); results per benchmark and device
in results/; what the numbers mean and which defaults they set: docs/performance.md.

Entry scripts run by path (`python benchmarks/bench.py`) start with the same guarded
bootstrap, the only sys.path edit here: when run that way (not with -m, not imported)
Python puts benchmarks/ rather than the repository root on sys.path, so the script puts
the root first, and `from benchmarks import harness` then finds this package.
"""
