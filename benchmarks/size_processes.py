"""bench.py with one process per size: every (T, V) group of cases starts on empty memory pools.

XLA's device memory pool never shrinks and grows by doubling regions (with
`XLA_PYTHON_CLIENT_PREALLOCATE=false`, as the bench runs to share the GPU with PyTorch). Over
one process's sizes it ends up holding regions that the largest size cannot use: on an H100
(80 GB) the pool held 34.4 GB, all free, when the fp32 T = 32,768 rows began; their 19.9 GB
logits took a new 34.4 GB region and the 19.9 GB gradient then fitted nowhere under XLA's 90%
limit (docs/performance.md, "One run on the H100"). A fresh process per size starts that
size with only the bandwidth measurement's regions.

The parent touches no GPU: it runs `bench.py` again for each size with the size as a filter,
the time budget left, and `--append` after the first (so the rows land in one file, each
row naming its run; `results_json.merge_previous`). The last child prints the tables of the
whole file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.cases import size_groups


def sizes(cases, mode):
    """The (T, V) groups of `cases` in the mode's priority order (`cases.size_groups`:
    the headline size first, so that a time budget cuts the least important)."""
    present = {(case.T, case.V) for case in cases}
    return [(T, V) for T, V, _ in size_groups(mode) if (T, V) in present]


def wanted(setting: str, cases, mode) -> bool:
    """--process-per-size: "on", "off", or "auto" (on where there is a CUDA GPU and more
    than one size). Asking torch whether CUDA is available creates no CUDA context."""
    if setting == "off" or len(sizes(cases, mode)) < 2:
        return False
    if setting == "on":
        return True
    import torch

    return torch.cuda.is_available()


def without_options(argv, names):
    """argv without the options in `names` and their values (`--opt v` or `--opt=v`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in names:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def run(argv, args, cases, mode) -> int:
    """Run bench.py once per size of `cases`; the exit status is the first child's that
    failed, else 0. `args.budget_s`: seconds for all of them (None: no budget)."""
    start = time.perf_counter()
    base = without_options(list(argv), {"--budget-s", "--append", "--process-per-size"})
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py")
    status = 0
    groups = sizes(cases, mode)
    for index, (num_tokens, num_vocab) in enumerate(groups):
        if args.budget_s is None:
            budget = "none"
        else:  # a spent budget still runs the child: its rows then say so
            budget = f"{max(0.0, args.budget_s - (time.perf_counter() - start)):.0f}"
        child = ([sys.executable, script] + base
                 + ["--filter", f"T={num_tokens}", "--filter", f"V={num_vocab}",
                    "--budget-s", budget, "--process-per-size", "off"]
                 + (["--append"] if index > 0 or args.append else []))
        print(f"[bench] size {index + 1} of {len(groups)}: T={num_tokens}, V={num_vocab} "
              f"in a process of its own (budget {budget} s)", flush=True)
        code = subprocess.call(child)
        if code and not status:
            status = code
            print(f"[bench] the process for T={num_tokens}, V={num_vocab} exited with {code}",
                  flush=True)
    print(f"[bench] {len(groups)} sizes in {time.perf_counter() - start:.0f} s", flush=True)
    return status
