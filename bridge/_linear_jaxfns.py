"""The JAX side of `bridge.linear_logprob_entropy`: one jitted function per static
configuration, as in `_jaxfns.py` (and counted by `_jaxfns.compiled_programs()`).

Each function runs on one row window (`_windows.py`) of `hidden [b, H]` with the whole
`weight [V_loc, H]`, so it compiles once per window size b, never per T. The chunk
size is resolved per window size inside the trace (`jaxops.linear.chunk_columns`).

Packed layouts as in `_jaxfns.py`: `outputs [n_out, b]`, `stats [K, b]`, incoming
gradients token-major `d_out [b, n]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bridge._jaxfns import cached, decode_targets, pack_outputs
from jaxops import linear_staged, staged
from jaxops.backends.registry import fused_backward_fits, fused_forward_fits
from jaxops.linear import chunk_columns


@cached
def local_forward(*, shard_index, world, inv_tau, with_entropy, masked, implementation,
                  config, target_mode, chunk_size, fused_wanted=False):
    """world == 1: (outputs [n_out, b], stats [1, K, b]); else this shard's stats [K, b].
    `fused_wanted` (`registry.fused_forward_wanted`): the fused forward kernel for
    the window sizes it applies to, decided per window size in the trace."""

    def fn(hidden, weight, raw_targets, keep_mask):
        targets = decode_targets(raw_targets, target_mode)
        chunk = chunk_columns(hidden.shape[0], weight.shape[0], chunk_size)
        fused = fused_wanted and fused_forward_fits(
            hidden.shape[0], hidden.shape[1], weight.shape[0], hidden.dtype, masked)
        packed = linear_staged.local_forward(
            hidden, weight, targets, keep_mask if masked else None, shard_index,
            inv_tau=inv_tau, with_entropy=with_entropy, implementation=implementation,
            config=config, chunk=chunk, fused_forward=fused)
        if world > 1:
            return packed
        gathered = packed[None]
        log_prob, entropy = staged.combine_gathered(
            gathered, targets, num_vocab=weight.shape[0], with_entropy=with_entropy,
            masked=masked)
        return pack_outputs(log_prob, entropy), gathered

    return jax.jit(fn)


@cached
def zero_accumulator():
    """fn(weight) -> fp32 zeros shaped like `weight`. `weight` (a view imported for this
    call) is an argument, kept although unused, so that this computation -- like every
    other of a bridge call -- waits for the import that ordered JAX after torch's
    stream before it writes memory that torch may just have released to JAX."""
    return jax.jit(lambda weight: jnp.zeros(weight.shape, jnp.float32), keep_unused=True)


@cached
def round_accumulator(*, dtype):
    return jax.jit(lambda acc: acc.astype(dtype))


@cached
def local_backward(*, shard_index, inv_tau, with_entropy, entropy_grad, masked,
                   has_d_log_prob, has_d_entropy, implementation, config, target_mode,
                   chunk_size, want_d_hidden, d_weight_mode, fused_wanted=False):
    """fn(hidden, weight, raw_targets, keep_mask, gathered [R, K, b], d_out [b, n], acc)
    -> (d hidden [b, H] or None, d weight [V_loc, H] or None).

    d_weight_mode: "direct" -- the call's only window: d weight in weight's dtype, each
    chunk's rows rounded once from their fp32 GEMM (`acc` is None); "accumulate" --
    `acc` + this window's d weight, fp32; `acc` is donated, so the windows of a call
    chain one accumulator through with no second copy alive; None: not computed.
    `fused_wanted`: the d logits from `jaxops.backends.mosaic.linear.backward_logits` (logits
    recomputed in the kernel) for the window sizes it applies to."""

    def fn(hidden, weight, raw_targets, keep_mask, gathered, d_out, acc):
        targets = decode_targets(raw_targets, target_mode)
        chunk = chunk_columns(hidden.shape[0], weight.shape[0], chunk_size)
        return linear_staged.local_backward(
            hidden, weight, targets, keep_mask if masked else None, gathered, shard_index,
            d_out[:, 0] if has_d_log_prob else None,
            d_out[:, -1] if has_d_entropy else None,
            acc if d_weight_mode == "accumulate" else None, inv_tau=inv_tau,
            with_entropy=with_entropy, entropy_grad=entropy_grad,
            implementation=implementation, config=config, chunk=chunk,
            want_d_hidden=want_d_hidden, want_d_weight=d_weight_mode == "direct",
            fused_logits=fused_wanted and fused_backward_fits(
                hidden.shape[0], hidden.shape[1], weight.shape[0], hidden.dtype, masked,
                chunk))

    return jax.jit(fn, donate_argnums=(6,) if d_weight_mode == "accumulate" else ())
