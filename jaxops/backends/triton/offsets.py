"""64-bit element offsets for large 1-byte arrays in JAX's Pallas Triton lowering.

The Triton lowering (`jax._src.pallas.triton.lowering._compute_offsets_from_indices`,
jax 0.10 to 0.12) computes the pointer offsets of a load or store in 32 bits unless
the operand is larger than 2**32 *bytes*. The offsets are counted in *elements* and
are signed, so for a 1-byte dtype -- our bool keep mask -- an array of 2**31 to 2**32
elements gets offsets that wrap past 2**31 - 1: at T = 16,384, V = 151,936 every row
from 14,134 on read another row's mask bits, silently. Operands of 2 bytes or more
are not affected (more than 2**31 elements is more than 2**32 bytes).

`ensure_64bit_offsets()` wraps that function so that any operand of 2**31 elements
or more is given 64-bit offsets (the decision is the only use the function makes of
the operand's dtype: we hand it the same shape with a 4-byte dtype). The wrap is
installed only if the function's source still contains the size rule described
above; otherwise (a JAX that changed or fixed it) nothing is patched and
`large_byte_operands_ok()` says whether that JAX is known to be safe, so that the
caller can take another path instead of returning wrong numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import threading

import numpy as np

# Element counts from which a signed 32-bit offset can overflow.
LARGE_ELEMENTS = 2**31

_lock = threading.Lock()
_state: dict = {}  # "patched": bool, set once


def _needs_64bit(aval) -> bool:
    return math.prod(aval.shape) >= LARGE_ELEMENTS


def _install() -> bool:
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:  # no Triton lowering in this JAX: nothing to fix
        return False
    original = getattr(lowering, "_compute_offsets_from_indices", None)
    if original is None or getattr(original, "_jaxops_64bit", False):
        return original is not None
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return False
    # The rule this wrap corrects; anything else is a lowering we have not read.
    if "full_size > 2**32" not in source or "itemsize" not in source:
        return False

    @functools.wraps(original)
    def offsets_64bit_for_large_operands(block_info, nd_indexer):
        aval = block_info.full_shape_dtype
        if _needs_64bit(aval) and np.dtype(aval.dtype).itemsize < 4:
            block_info = dataclasses.replace(
                block_info, full_shape_dtype=aval.update(dtype=np.dtype(np.int32)))
        return original(block_info, nd_indexer)

    offsets_64bit_for_large_operands._jaxops_64bit = True
    lowering._compute_offsets_from_indices = offsets_64bit_for_large_operands
    return True


def ensure_64bit_offsets() -> bool:
    """Install the wrap once; True if the Triton lowering now uses 64-bit offsets for
    every operand of 2**31 elements or more."""
    with _lock:
        if "patched" not in _state:
            _state["patched"] = _install()
        return _state["patched"]


def large_byte_operands_ok(*arrays) -> bool:
    """False if one of `arrays` is a 1-byte operand of 2**31+ elements and the
    lowering could not be made to index it in 64 bits."""
    risky = [a for a in arrays if a is not None and np.dtype(a.dtype).itemsize == 1
             and math.prod(a.shape) >= LARGE_ELEMENTS]
    return not risky or ensure_64bit_offsets()
