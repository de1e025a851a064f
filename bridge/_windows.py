"""Row windows: any number of tokens T from a few compiled shapes, without copying logits.

JAX compiles a program per input shape, and a PPO trainer's T changes on nearly every
micro-batch. The bridge therefore never hands JAX a `[T, V_loc]` array of arbitrary T:
it cuts the rows into *windows* whose sizes are powers of two (at most `MAX_WINDOW`),
each a zero-copy view of the torch tensor, and runs the compiled program of that size
on each. The per-row op makes this exact: a row's results do not depend on which
other rows share its call (the kernels are bitwise batch invariant).

To keep the number of launches small, at most `MAX_PIECES` windows cover a remainder:
the first ones are the largest powers of two that fit, and the last one is the
smallest power of two that covers what is left, *ending at row T* -- so it starts
before the rows it is needed for and recomputes up to `size - new` rows that an
earlier window already did (identical values; their stores of the gradient write the
same bytes twice, in stream order). The extra work is at most 1/7 of T (T = 2**k +
2**(k-1) + 2**(k-2) + 1), and zero when T is a power of two.

So for T up to 2**k the programs compiled per configuration are the k + 1 window
sizes 1, 2, 4, ..., 2**k, for the forward and the backward each.

Every window's first row must start on a 16-byte boundary in each `[T, V_loc]` operand
(JAX's GPU kernels assume aligned buffers), which holds for every row when V_loc times
the smallest element size is a multiple of 16 (true for padded vocabularies: Megatron
pads V to a multiple of 128 per rank). Otherwise the windows start only on rows that
are multiples of `row_align`, and a T that is not such a multiple is one window of
exactly T rows (compiled once per such T).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

MAX_WINDOW = 2**15  # rows; larger T is a sequence of such windows plus a remainder
MAX_PIECES = 3  # windows covering the remainder below MAX_WINDOW


class Window(NamedTuple):
    start: int  # first row computed
    size: int  # rows computed, a power of two (or T itself, see row_align)
    skip: int  # leading rows of this window that an earlier window already produced


def row_align(row_bytes: int, alignment: int) -> int:
    """Smallest row count whose span in every operand is a multiple of `alignment`
    bytes (a power of two: 16 for CUDA buffers, 64 for JAX's CPU client).

    `row_bytes`: the bytes of one row of the operand with the smallest rows (V_loc
    times the smallest element size among logits, gradient and keep mask)."""
    align = 1
    while (align * row_bytes) % alignment:
        align *= 2
    return align


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _ceil_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=4096)
def row_windows(num_tokens: int, align: int = 1) -> tuple[Window, ...]:
    """Windows covering rows `[0, num_tokens)`; see the module docstring."""
    if num_tokens <= 0:
        return ()
    if num_tokens % align:
        return (Window(0, num_tokens, 0),)
    windows = []
    start = 0
    while num_tokens - start >= MAX_WINDOW:
        windows.append(Window(start, MAX_WINDOW, 0))
        start += MAX_WINDOW
    pieces = 0
    while start < num_tokens:
        left = num_tokens - start
        pieces += 1
        size = _floor_pow2(left)
        if size == left or pieces < MAX_PIECES or start == 0:
            windows.append(Window(start, size, 0))
            start += size
        else:
            # The last piece: a power of two ending at row T. It fits, since an earlier
            # window of at least this size precedes it; it starts on an aligned row,
            # since T, start and this size are multiples of `align`.
            size = _ceil_pow2(left)
            windows.append(Window(num_tokens - size, size, size - left))
            start = num_tokens
    return tuple(windows)
