"""The direct route's kernels (`direct.py`) composed in JAX: one shard's forward and
gradient for whole rows, with the operands and outputs the bridge's launcher hands them.
The interpret-mode tests run the kernels through these; the bridge launches the kernels
itself, without XLA."""

from __future__ import annotations

import jax.numpy as jnp

from jaxops.backends.mosaic.common import mask_bytes
from jaxops.backends.mosaic.config import MosaicConfig
from jaxops.backends.mosaic.direct import (backward_kernel, finish_kernel, forward_kernel,
                                           one_pass, partials_kernel, saved_names)


def logprob_entropy_rows(logits, targets, keep_mask=None, *, inv_tau=1.0, with_entropy=True,
                         gathered_target=False, single_kernel=None, wide_targets=False,
                         config: MosaicConfig | None = None):
    """(log_prob [T], entropy [T] or None, saved {name: [padded]}) of one shard (R = 1)
    through the direct route's forward kernels: `forward_kernel` where `single_kernel`
    (None: where `one_pass` and not `gathered_target`, as the bridge chooses), else the
    partials and finish kernels. `targets` int32 [T], or with `wide_targets` int64 ids
    as their little-endian int32 words, [2T]."""
    num_tokens, num_vocab = logits.shape
    masked = keep_mask is not None
    operands = [logits] + ([mask_bytes(keep_mask)] if masked else [])
    if single_kernel is None:
        single_kernel = not gathered_target and one_pass(num_vocab, logits.dtype, masked,
                                                          config)
    if single_kernel:
        outs = list(forward_kernel(num_tokens, num_vocab, logits.dtype, masked=masked,
                                   with_entropy=with_entropy, inv_tau=inv_tau,
                                   wide_targets=wide_targets, config=config)(*operands,
                                                                             targets))
    else:
        outs = _two_kernel_forward(logits, targets, keep_mask, operands, inv_tau=inv_tau,
                                   with_entropy=with_entropy, gathered_target=gathered_target,
                                   wide_targets=wide_targets, config=config)
    log_prob = outs.pop(0)[:num_tokens]
    entropy = outs.pop(0)[:num_tokens] if with_entropy else None
    return log_prob, entropy, dict(zip(saved_names(with_entropy, masked), outs))


def _two_kernel_forward(logits, targets, keep_mask, operands, *, inv_tau, with_entropy,
                        gathered_target, wide_targets, config):
    num_tokens, num_vocab = logits.shape
    masked = keep_mask is not None
    common = dict(masked=masked, with_entropy=with_entropy, inv_tau=inv_tau,
                  gathered_target=gathered_target, wide_targets=wide_targets, config=config)
    operands = list(operands)
    if not gathered_target:
        operands.append(targets)
    parts = partials_kernel(num_tokens, num_vocab, logits.dtype, **common)(*operands)
    gathered = []
    if gathered_target:  # what the bridge gathers with torch ops
        ids = targets.reshape(-1, 2)[:, 0] if wide_targets else targets  # any valid id's
        index = jnp.clip(ids, 0, num_vocab - 1)[:, None]
        gathered.append(jnp.take_along_axis(logits, index, axis=1)[:, 0].astype(jnp.float32))
        if masked:
            bit = jnp.take_along_axis(keep_mask, index, axis=1)[:, 0]
            gathered.append(bit.astype(jnp.float32))
    return list(finish_kernel(num_tokens, num_vocab, logits.dtype, **common)(
        *parts, targets, *gathered))


def logits_grad_rows(logits, targets, keep_mask, saved, d_log_prob, d_entropy, *,
                     inv_tau=1.0, with_entropy=True, entropy_grad=True, wide_targets=False,
                     config: MosaicConfig | None = None):
    """d loss / d logits `[T, V]` through the direct route's backward kernel (JAX form);
    `targets` as for `logprob_entropy_rows`."""
    num_tokens, num_vocab = logits.shape
    masked = keep_mask is not None
    has_d_entropy = d_entropy is not None and with_entropy and entropy_grad
    fn = backward_kernel(num_tokens, num_vocab, logits.dtype, masked=masked,
                         with_entropy=with_entropy, entropy_grad=entropy_grad,
                         has_d_log_prob=d_log_prob is not None, has_d_entropy=has_d_entropy,
                         inv_tau=inv_tau, wide_targets=wide_targets, config=config,
                         into=False)
    operands = ([logits] + ([mask_bytes(keep_mask)] if masked else []) + [targets]
                + [saved[n] for n in saved_names(with_entropy, masked)]
                + ([d_log_prob.astype(jnp.float32)] if d_log_prob is not None else [])
                + ([d_entropy.astype(jnp.float32)] if has_d_entropy else []))
    grad = fn(*operands)
    return grad[:num_tokens, :num_vocab]
