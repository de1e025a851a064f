"""A bool keep mask handed to a Mosaic GPU kernel as its bytes, without an XLA pass.

Why: Mosaic GPU types a bool ref as i1 (one bit per element), so its TMA cannot copy
XLA's bool buffers, which hold one byte (0 or 1) per element. `astype(uint8)` gives the
kernels bytes at the cost of one XLA pass over the mask (T * V_loc bytes read and
written; on the H200 1.48 ms, more than the 0.9 ms bf16 forward it feeds). JAX has no
view for it: `lax.bitcast_convert_type` refuses bool, and StableHLO's bitcast of i1
packs eight elements into a byte.

How: `bytes_view(mask)` is uint8 in the jaxpr, so the kernel is traced with a uint8
operand, but it lowers to the bool operand itself. The Mosaic GPU custom call takes
its operands as untyped buffers (XLA FFI `RemainingArgs`), so the kernel reads the
bool buffer's bytes in place.

Use it only as the direct operand of a Mosaic GPU kernel (`plgpu.kernel` /
`pallas_call`) under jit, never in interpret mode (the interpreter evaluates the kernel
in XLA). Another consumer of the view sees an i1 value where its type says ui8: MLIR
verification rejects the module (an arithmetic op, a comparison, a slice, a jit
output), so misuse fails to lower rather than computing with wrong bits; the one
exception, a convert, reads the same 0/1 values. Outside jit it is a plain convert.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

# Whether the Mosaic kernels take bool masks through `bytes_view` (`common.mask_bytes`)
# and "pallas" routes bool masks to them (`registry.pallas_backend`). Checked on the GPU (tests/jaxops/test_mask_view.py, `gpu` marker); False
# gives the XLA conversion to uint8 before each kernel (a pass over the mask). Read when
# a kernel call is traced: set it before a jitted function's first call (jit keeps the
# trace it made).
ENABLED = True

_bytes_view_p = Primitive("mask_bytes_view")
# Only dtype changes: vma (shard_map) and sharding carry over.
_bytes_view_p.def_abstract_eval(lambda mask: mask.update(dtype=jnp.dtype(jnp.uint8),
                                                         weak_type=False))
_bytes_view_p.def_impl(lambda mask: mask.astype(jnp.uint8))
mlir.register_lowering(_bytes_view_p, lambda ctx, mask: [mask])


def _batch(args, dims):
    # The batch axis moves to the front on the bool side: a kernel's batching rule that
    # moved it on the view would be a transpose of the view, which fails to lower.
    (mask,), (dim,) = args, dims
    if dim is None:
        return _bytes_view_p.bind(mask), None
    return _bytes_view_p.bind(jnp.moveaxis(mask, dim, 0)), 0


batching.primitive_batchers[_bytes_view_p] = _batch


def bytes_view(keep_mask):
    """`keep_mask` `[T, V_loc]` bool as uint8 (1 = kept) for a Mosaic GPU kernel's
    operand, with no copy under jit (see the module docstring for where it may go)."""
    if keep_mask.dtype != jnp.bool_:
        raise TypeError(f"bytes_view takes a bool mask, got {keep_mask.dtype}")
    return _bytes_view_p.bind(keep_mask)
