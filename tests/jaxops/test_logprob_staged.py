"""`jaxops.staged` (the staged protocol: local forward, combine of the gathered
statistics, local backward) on 1, 2 and 4 vocabulary shards in one process, against the
float64 reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import staged

from _logprob_cases import (
    BASE_LEAD, BASE_TAU, BASE_V, BF16, F32, FLAG_IDS, FLAGS, assert_gradient_within_roundings,
    assert_matches_reference, dtype_id, interpret_config, make_inputs, random_cotangents,
    target_alone_inputs,
)


# ---------------------------------------------------------------------- staged API


def run_staged(logits, targets, keep_mask, num_shards, *, temperature, with_entropy,
               entropy_grad, implementation, g_lp, g_h):
    """The staged protocol with `num_shards` vocabulary slices in one process."""
    num_vocab = logits.shape[-1] // num_shards
    config = interpret_config() if implementation == "pallas" else None
    cols = [slice(r * num_vocab, (r + 1) * num_vocab) for r in range(num_shards)]
    shard_logits = [logits[:, c] for c in cols]
    shard_masks = [None if keep_mask is None else keep_mask[:, c] for c in cols]
    common = dict(inv_tau=1.0 / temperature, with_entropy=with_entropy,
                  implementation=implementation, config=config)
    packed = [staged.local_forward(shard_logits[r], targets, shard_masks[r], r, **common)
              for r in range(num_shards)]
    num_rows = staged.num_packed(with_entropy, keep_mask is not None)
    for p in packed:
        assert p.shape == (num_rows, targets.shape[0]) and p.dtype == F32
    gathered = jnp.stack(packed)
    log_prob, entropy = staged.combine_gathered(
        gathered, targets, num_vocab=num_vocab, with_entropy=with_entropy,
        masked=keep_mask is not None)
    grads = [staged.local_backward(shard_logits[r], targets, shard_masks[r], gathered, r,
                                   g_lp, g_h if with_entropy else None,
                                   entropy_grad=entropy_grad, **common)
             for r in range(num_shards)]
    return log_prob, entropy, jnp.concatenate(grads, axis=-1)


def staged_inputs(mask, dtype=F32):
    logits, targets, keep_mask = make_inputs(
        16, BASE_LEAD, BASE_V, dtype, mask=None if mask == "first_quarter" else mask)
    if mask == "first_quarter":
        # Only the first quarter of the vocabulary can be kept, so with 4 shards the
        # others hold no kept token (and, in most rows, not the target either).
        keep = np.random.default_rng(16).random(logits.shape) < 0.3
        keep[:, BASE_V // 4:] = False
        keep_mask = jnp.asarray(keep)
    return logits, targets, keep_mask


def check_staged(implementation, num_shards, mask, with_entropy=True, entropy_grad=True,
                 dtype=F32):
    logits, targets, keep_mask = staged_inputs(mask, dtype)
    g_lp, g_h = random_cotangents(16, BASE_LEAD)
    outputs = run_staged(logits, targets, keep_mask, num_shards, temperature=BASE_TAU,
                         with_entropy=with_entropy, entropy_grad=entropy_grad,
                         implementation=implementation, g_lp=g_lp, g_h=g_h)
    assert_matches_reference(logits, targets, keep_mask, BASE_TAU, *outputs, g_lp, g_h,
                             with_entropy=with_entropy, entropy_grad=entropy_grad)


STAGED_IMPLEMENTATIONS = [
    "xla",
    # Interpreted Pallas is slow: on CPU, test_staged_pallas covers it at 4 shards.
    pytest.param("pallas", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("implementation", STAGED_IMPLEMENTATIONS)
@pytest.mark.parametrize("num_shards", [1, 2, 4])
@pytest.mark.parametrize("mask", [None, "mixed", "first_quarter"])
def test_staged(implementation, num_shards, mask):
    check_staged(implementation, num_shards, mask)


@pytest.mark.parametrize("implementation", STAGED_IMPLEMENTATIONS)
@pytest.mark.parametrize("num_shards", [2, 4])
@pytest.mark.parametrize("with_entropy,entropy_grad", FLAGS[1:], ids=FLAG_IDS[1:])
def test_staged_flags(implementation, num_shards, with_entropy, entropy_grad):
    check_staged(implementation, num_shards, "mixed", with_entropy, entropy_grad)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_staged_pallas(dtype):
    check_staged("pallas", 4, "first_quarter", dtype=dtype)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("target_bit", [False, True], ids=["bit_off", "bit_on"])
def test_staged_target_alone_on_one_of_four_shards(implementation, target_bit):
    """The target-alone rows of test_target_alone_far_below_the_maximum_has_zero_gradient
    on 4 vocabulary shards: the kept set is a point mass on one shard while the others
    keep nothing, and the combine over shards still sees it (log_prob's gradient 0 to a
    few roundings of |g_lp| / tau), whether the mask's bit keeps the target or not (the
    Triton forward's kept count)."""
    logits, targets, keep_mask = target_alone_inputs(16, 300, target_bit)
    g_lp, g_h = random_cotangents(6, (16,))
    outputs = run_staged(logits, targets, keep_mask, 4, temperature=0.3, with_entropy=False,
                         entropy_grad=False, implementation=implementation, g_lp=g_lp,
                         g_h=g_h)
    assert_matches_reference(logits, targets, keep_mask, 0.3, *outputs, g_lp, g_h,
                             with_entropy=False, entropy_grad=False)
    assert_gradient_within_roundings(outputs[2], g_lp)
