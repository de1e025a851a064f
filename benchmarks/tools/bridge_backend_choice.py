"""Which backend the bridge's default should use, per shape (issues 12 and 14).

    python -m benchmarks.tools.bridge_backend_choice [--out FILE.json] [--quick]

In eager PyTorch on one GPU, `implementation="pallas_mosaic"` takes the direct route
(`bridge/_direct.py`: Mosaic kernels launched from torch, no JAX runtime), while
"pallas_triton" goes through JAX (DLPack hand-overs, jitted calls): a fixed host cost per
call that the GPU hides only when its own work is longer. Where V_loc is small the Mosaic
kernels alone are slower than Triton's (benchmarks/tools/backend_choice.py), so which route wins
depends on T * V_loc. Per case this times `bridge.logprob_entropy` + `torch.autograd.grad`
(int64 targets, entropy on, a bool keep mask where named) with each backend, in turns:
median over 5 pairs of loops of the mean µs per call of 30 synchronised calls. Prints and
writes one row per case: {T, V, dtype, masked, pallas_mosaic: µs, pallas_triton: µs,
pallas: µs} ("pallas", the default, takes the direct route since this comparison).
"""
if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import os, statistics  # noqa: E401

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402

IMPLS = ("pallas_mosaic", "pallas_triton", "pallas")  # "pallas": the default, for the record


def cases(quick):
    tokens = (16, 1024, 4096, 8192, 16384, 32768)
    out = [(t, v, torch.bfloat16, False) for v in (18992, 37984) for t in tokens]
    out += [(t, 18992, torch.float32, False) for t in tokens]
    out += [(t, 18992, torch.bfloat16, True) for t in (1024, 8192, 32768)]
    out += [(16, 1024, d, False) for d in (torch.float32, torch.bfloat16)]
    return out[:3] if quick else out


def run_case(num_tokens, num_vocab, dtype, masked, calls=30, pairs=5):
    import bridge

    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(num_tokens, num_vocab, device=dev, dtype=dtype, requires_grad=True)
    y = torch.randint(0, num_vocab, (num_tokens,), device=dev)
    g = torch.randn(num_tokens, device=dev)
    m = torch.rand(num_tokens, num_vocab, device=dev) < 0.05 if masked else None

    def step(impl):
        def run():
            lp, h = bridge.logprob_entropy(x, y, keep_mask=m, implementation=impl)
            torch.autograd.grad([lp, h], [x], [g, g])
        return run

    steps = {impl: step(impl) for impl in IMPLS}
    for run in steps.values():  # compile, then warm
        for _ in range(3):
            run()
    times = {impl: [] for impl in IMPLS}
    for _ in range(pairs):
        for impl, run in steps.items():
            times[impl].append(harness.mean_call_us(run, calls, torch.cuda.synchronize))
    row = dict(T=num_tokens, V=num_vocab, dtype=str(dtype).removeprefix("torch."),
               masked=masked)
    row.update({impl: round(statistics.median(t), 1) for impl, t in times.items()})
    return row


def main():
    harness.run_case_table(__doc__.splitlines()[0], cases, run_case,
                           after_case=torch.cuda.empty_cache)


if __name__ == "__main__":
    main()
