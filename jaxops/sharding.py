"""Vocab-parallel log-prob and entropy on global arrays: the `shard_map` wrapper.

Inside your own `jax.shard_map`, call `jaxops.logprob_entropy(..., axis_name=...)`
on each shard's `[..., V_loc]` slice. Holding *global* arrays instead (for example
under `jax.jit` with a `NamedSharding` over the vocabulary), call
`vocab_parallel_logprob_entropy`: it runs that same per-shard code under
`jax.shard_map` on your mesh, so the kernels see only their own slice and the
shards exchange two O(T) messages in the forward and none in the backward.

Why a wrapper at all: XLA cannot partition a `pallas_call`. Plain
`jax.jit(jaxops.logprob_entropy)` on vocab-sharded arrays gives correct values
and gradients, but XLA's partitioner decides the communication: for the Pallas
kernels (opaque to it) expect the `[T, V]` logits to be gathered onto every
device; for `implementation="xla"` it partitions the reductions itself (two
O(T) all-reduces measured on CPU). This wrapper never moves `[T, V]` data.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from jaxops import validate
from jaxops.api import logprob_entropy
from jaxops.backends import registry
from jaxops.backends.triton.config import PallasConfig


def _axis_names(token_axis) -> tuple:
    if token_axis is None:
        return ()
    if isinstance(token_axis, str):
        return (token_axis,)
    if isinstance(token_axis, (tuple, list)) and all(isinstance(a, str) for a in token_axis):
        return tuple(token_axis)
    raise TypeError(f"token_axis must be None, a mesh axis name or a tuple of names, "
                    f"got {token_axis!r}")


def _uses_check_vma(implementation: str, config: PallasConfig | None) -> bool:
    """check_vma=True (no collective in the backward) except for interpreted Pallas.

    JAX's Pallas interpreter cannot evaluate a kernel whose inputs are typed as
    varying over mesh axes, so the interpret path (Pallas off-GPU) runs with
    check_vma=False, where the backward costs one extra O(T) psum. Takes what
    `registry.resolve` returns.
    """
    return not (registry.is_pallas(implementation) and config.interpret)


def vocab_parallel_logprob_entropy(
    logits: jax.Array,  # [..., V] global, ideally sharded over `vocab_axis` on its last dim
    targets: jax.Array,  # [...] integer global vocabulary ids
    *,
    mesh,
    vocab_axis: str,
    token_axis=None,
    keep_mask: jax.Array | None = None,  # [..., V] bool or uint8 (nonzero = kept)
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    implementation: str | None = None,
    pallas_config: PallasConfig | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """`jaxops.logprob_entropy` on global arrays, vocab-parallel over a mesh axis.

    Runs the op under `jax.shard_map` on `mesh`: device `i` along `vocab_axis`
    gets the logit (and keep-mask) columns `[i * V_loc, (i + 1) * V_loc)` with
    `V_loc = V / mesh.shape[vocab_axis]`, the global targets, and computes its
    statistics locally; the shards combine them with one `pmax` and one `psum`
    of O(T) floats. Works eagerly and under `jax.jit` / `jax.grad` / `jax.vjp`.
    Inputs with another sharding are resharded by XLA on the way in; pass them
    already laid out as `P(token_axis, ..., vocab_axis)` to avoid that.

    Args:
      logits, targets, keep_mask, temperature, with_entropy, entropy_grad,
      implementation, pallas_config: as for `jaxops.logprob_entropy`, with
        global shapes (`logits [..., V]`). `implementation="reference"` is not
        vocab-parallel and is refused.
      mesh: a `jax.sharding.Mesh` (multi-host: built from `jax.devices()` after
        `jax.distributed.initialize()`).
      vocab_axis: the mesh axis the vocabulary is split over; its size must
        divide V.
      token_axis: optional mesh axis name (or tuple of names) that the first
        dimension of `logits` / `targets` is sharded over, e.g. a data-parallel
        axis. It must differ from `vocab_axis` and its size must divide
        `logits.shape[0]`. Without it every vocab shard handles all tokens.

    Returns:
      `(log_prob, entropy)` as global float32 `[...]` arrays, sharded like
      `P(token_axis)` (replicated over `vocab_axis`); `entropy` is None when
      `with_entropy=False`. The gradient w.r.t. `logits` has the logits'
      dtype and sharding `P(token_axis, ..., vocab_axis)`.

    Gradients are right in both `check_vma` modes; this wrapper uses
    `check_vma=True` (no collective in the backward), except for Pallas in
    interpret mode (off-GPU), which JAX can only run with `check_vma=False`
    (one O(T) psum in the backward).
    """
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not isinstance(vocab_axis, str) or vocab_axis not in mesh.axis_names:
        raise ValueError(f"vocab_axis must name an axis of the mesh {tuple(mesh.axis_names)}, "
                         f"got {vocab_axis!r}")
    token_axes = _axis_names(token_axis)
    for name in token_axes:
        if name not in mesh.axis_names:
            raise ValueError(f"token_axis {name!r} is not an axis of the mesh "
                             f"{tuple(mesh.axis_names)}")
    if vocab_axis in token_axes or len(set(token_axes)) != len(token_axes):
        raise ValueError(f"token_axis {token_axis!r} must not repeat an axis or use "
                         f"vocab_axis {vocab_axis!r}")
    if implementation == registry.REFERENCE:
        raise ValueError("implementation='reference' is unsharded; it is not vocab-parallel")

    impl, config = registry.resolve(implementation, pallas_config=pallas_config)
    validate.check_inputs(logits, targets, keep_mask, impl)
    num_shards = mesh.shape[vocab_axis]
    num_vocab = logits.shape[-1]
    if num_vocab % num_shards:
        raise ValueError(
            f"the vocabulary (V = {num_vocab}) must split evenly over mesh axis "
            f"{vocab_axis!r} of size {num_shards}: every shard holds the same number of columns")
    if token_axes:
        if logits.ndim < 2:
            raise ValueError("token_axis needs logits with a token dimension, [T, ..., V]")
        token_shards = math.prod(mesh.shape[a] for a in token_axes)
        if logits.shape[0] % token_shards:
            raise ValueError(
                f"logits.shape[0] = {logits.shape[0]} must split evenly over token_axis "
                f"{token_axis!r} ({token_shards} shards)")
    # Range check in eager calls (inside jit, a bad target gives NaN in its row).
    validate.check_targets_in_range(targets, num_vocab)

    # Token dims: the first one over token_axis (if any), the rest whole.
    lead = ()
    if logits.ndim >= 2:
        lead = (token_axes or None,) + (None,) * (logits.ndim - 2)
    row_spec = P(*lead)
    matrix_spec = P(*lead, vocab_axis)
    options = dict(temperature=temperature, with_entropy=with_entropy,
                   entropy_grad=entropy_grad, implementation=implementation,
                   pallas_config=pallas_config, axis_name=vocab_axis)

    def per_shard(logits, targets, *mask):
        log_prob, entropy = logprob_entropy(
            logits, targets, keep_mask=mask[0] if mask else None, **options)
        return (log_prob, entropy) if with_entropy else (log_prob,)

    args = (logits, targets) + (() if keep_mask is None else (keep_mask,))
    in_specs = (matrix_spec, row_spec) + (() if keep_mask is None else (matrix_spec,))
    out_specs = (row_spec, row_spec) if with_entropy else (row_spec,)
    outs = jax.shard_map(
        per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
        check_vma=_uses_check_vma(impl, config))(*args)
    return outs if with_entropy else (outs[0], None)
