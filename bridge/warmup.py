"""`bridge.warmup`: compile, before training, every program a run's calls will need.

A call compiles one program per row-window size it meets for the first time
(`_windows.py`), so an RL run whose T changes every micro-batch keeps compiling through
its first steps. `warmup(max_tokens, ...)` runs the real op -- forward and backward,
through the same code a training call takes -- once per window size up to
`max_tokens` on small dummy tensors (zeros), which compiles exactly the programs those
later calls look up (with the persistent cache on, `bridge/cache.py`, a later process loads
them from disk instead). Only what decides a program must match the later calls:
vocabulary size, dtype, mask or not, target dtype, temperature, entropy flags,
implementation, process group size and, for the fused head, H and chunk_size.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from typing import Callable, NamedTuple, Optional, Union

import torch

from bridge import _dlpack, _jaxfns
from bridge._windows import MAX_WINDOW, row_align
from bridge.linear import linear_logprob_entropy
from bridge.op import logprob_entropy

__all__ = ["WarmupReport", "compiled_programs", "warmup"]


class WarmupReport(NamedTuple):
    programs: int  # programs compiled (or loaded from the persistent cache) by the warm-up
    seconds: float  # wall time of the warm-up
    windows: tuple  # the row-window sizes warmed, ascending
    total_programs: int  # programs the bridge holds now, all configurations


def compiled_programs() -> int:
    """Programs the bridge has compiled in this process so far (every configuration; a
    program loaded from the persistent cache counts too), the direct route's kernels
    included."""
    return _jaxfns.compiled_programs()


def _window_sizes(max_tokens: int, align: int) -> list[int]:
    """Every window size a call of T <= max_tokens can use (T a multiple of `align`):
    the powers of two from `align` up to the largest one <= min(max_tokens, MAX_WINDOW)."""
    top = min(max_tokens, MAX_WINDOW)
    sizes, size = [], align
    while size <= top:
        sizes.append(size)
        size *= 2
    return sizes


def _reporter(progress):
    if progress is True:
        return lambda line: print(line, file=sys.stderr, flush=True)
    return progress or (lambda line: None)


def warmup(
    max_tokens: int,
    vocab_size: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: Union[str, torch.device, None] = None,
    masked: bool = False,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    backward: bool = True,
    implementation: Optional[str] = None,
    target_dtype: torch.dtype = torch.int64,
    process_group=None,
    hidden_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    progress: Union[bool, Callable[[str], None]] = True,
    threads: int = 1,
) -> WarmupReport:
    """Compile the programs of every row window a call with T <= `max_tokens` uses.

    Runs `bridge.logprob_entropy` (or, with `hidden_size`, `bridge.linear_logprob_entropy`
    with weight `[vocab_size, hidden_size]`) on zero tensors of T = each window size,
    forward and (`backward`) backward with a loss of log_prob plus, when `with_entropy`
    and `entropy_grad`, entropy -- pass `entropy_grad=False` if your loss never
    differentiates the entropy: the backward then takes other programs.

    Args:
      max_tokens: the largest T the run will pass. Windows are at most 32,768 rows, so
        any larger T needs nothing more.
      vocab_size: V_loc, the columns of this rank's logits (rows of its weight shard).
      dtype, masked (a keep_mask of all True), temperature, with_entropy, entropy_grad,
        implementation, target_dtype (int64 or int32), process_group, chunk_size: as
        the training calls will pass them. With a process group every rank calls
        `warmup` with the same arguments (the op's collectives run).
      device: default the current CUDA device if there is one, else the CPU.
      progress: True: one line per compiled step (a window's forward, its backward) and
        a summary on stderr; a callable: gets those lines instead; False: silent.
      threads: window sizes warmed at once. The compiles release Python's GIL (XLA's,
        and Mosaic's compile of the direct route's kernels, which runs in every process
        even with a warm persistent cache), so on a many-core host several threads cut
        the warm-up's wall time. Ignored with a process group of several ranks, whose
        collectives must run in the same order on every rank.

    Returns:
      `WarmupReport(programs, seconds, windows, total_programs)`.

    T that is not a multiple of the vocabulary's row alignment (V_loc times the element
    size not a multiple of 16 bytes on CUDA, 64 on CPU) is one window of exactly T rows
    (`bridge/_windows.py`): such T cannot be warmed up in advance.
    """
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    report = _reporter(progress)
    linear = hidden_size is not None
    row_bytes = (hidden_size * torch.finfo(dtype).bits // 8 if linear
                 else vocab_size * (1 if masked else torch.finfo(dtype).bits // 8))
    align = row_align(row_bytes, _dlpack.device(device).alignment)
    if linear and masked:
        align = max(align, row_align(vocab_size, _dlpack.device(device).alignment))
    sizes = _window_sizes(max_tokens, align)
    # The fused head's d weight takes other programs where a call has several windows
    # (an fp32 accumulator): T = size + align has windows (size, align), and T = 3 align
    # has (2 align, align).
    steps = [(size, size) for size in sizes]
    if linear and backward:
        several = [(size + align if size > align else 3 * align, size) for size in sizes]
        steps += [(t, size) for t, size in several if t <= max_tokens]
    top = max(t for t, _ in steps) if steps else 0
    kw = dict(dtype=dtype, device=device)
    # A fresh context per step: grad mode is per thread, and a context object holds state.
    grad_mode = torch.enable_grad if backward else torch.no_grad
    ids = torch.zeros(top, dtype=target_dtype, device=device)
    mask = torch.ones(top, vocab_size, dtype=torch.bool, device=device) if masked else None
    if linear:
        weight = torch.zeros(vocab_size, hidden_size, **kw)
        rows = torch.zeros(top, hidden_size, **kw)
    else:
        rows = torch.zeros(top, vocab_size, **kw)
    if process_group is not None and torch.distributed.get_world_size(process_group) > 1:
        threads = 1  # collectives must run in the same order on every rank

    def run_step(num_tokens, size):
        x = rows[:num_tokens].detach().requires_grad_(backward)
        # Each step its own leaf of the weight: threads never accumulate into one .grad.
        w = weight.detach().requires_grad_(backward) if linear else None
        args = dict(keep_mask=None if mask is None else mask[:num_tokens],
                    temperature=temperature, with_entropy=with_entropy,
                    entropy_grad=entropy_grad, implementation=implementation,
                    process_group=process_group)
        what = f"window {size:>5}" + (f" (T = {num_tokens})" if num_tokens != size else "")
        with grad_mode():
            before, t0 = compiled_programs(), time.perf_counter()
            if linear:
                lp, ent = linear_logprob_entropy(x, w, ids[:num_tokens],
                                                 chunk_size=chunk_size, **args)
            else:
                lp, ent = logprob_entropy(x, ids[:num_tokens], **args)
            _sync(device)
            _line(report, what, "forward", compiled_programs() - before, t0, threads)
            if backward:
                before, t0 = compiled_programs(), time.perf_counter()
                loss = lp.sum() + (ent.sum() if with_entropy and entropy_grad else 0.0)
                loss.backward()
                _sync(device)
                _line(report, what, "backward", compiled_programs() - before, t0, threads)

    first = compiled_programs()
    start = time.perf_counter()
    if threads > 1:
        # Largest windows first: they compile longest, so the pool ends together.
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for future in [pool.submit(run_step, *step) for step in reversed(steps)]:
                future.result()
    else:
        for step in steps:
            run_step(*step)
    seconds = time.perf_counter() - start
    total = compiled_programs()
    result = WarmupReport(total - first, seconds, tuple(sizes), total)
    report(f"bridge.warmup: {result.programs} programs for {len(sizes)} window sizes "
           f"({sizes[0] if sizes else 0}..{sizes[-1] if sizes else 0} rows) in "
           f"{seconds:.2f} s")
    return result


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _line(report, what, step, programs, t0, threads):
    # With several threads the count of programs would include the other threads'.
    count = f"{programs} program(s), " if threads == 1 else ""
    report(f"bridge.warmup: {what} {step:<8}: {count}{time.perf_counter() - t0:.2f} s")
