"""The Triton kernels' walk over the vocabulary through `jaxops.logprob_entropy`: several
full tiles with and without a partial tail, small explicit tiles, the kernel variants
(`PallasConfig` skip_rescale, prefetch, scalar_sums) against the default kernel and the
float64 reference, and the tuned defaults docs/performance.md documents."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from jaxops.backends.triton.config import with_tuned_defaults

from _logprob_cases import (
    BF16, F32, FAST, check_against_reference, dtype_id, interpret_config, make_inputs,
)


def pallas_tiles(num_vocab, dtype, mask, block_v=None):
    """(full tiles, partial tail, tile size) of a Pallas kernel's walk over V: the
    tuned default tile (triton.config.with_tuned_defaults: 2048 columns, 1024 with a
    mask, for every dtype) unless `block_v` is given."""
    block = with_tuned_defaults(jaxops.PallasConfig(block_v=block_v), num_vocab,
                                masked=mask is not None, itemsize=jnp.dtype(dtype).itemsize)
    return (*divmod(num_vocab, block.block_v), block.block_v)


def tile_case_id(implementation, lead, num_vocab, dtype, mask, block_v):
    """e.g. "pallas-8229-bfloat16-mask_random-8x1024+37": 8 full tiles of 1024, a tail of 37."""
    case_id = f"{implementation}-{num_vocab}-{dtype_id(dtype)}-mask_{mask}"
    if implementation != "pallas":
        return case_id
    full, tail, block = pallas_tiles(num_vocab, dtype, mask, block_v)
    return f"{case_id}-{full}x{block}" + (f"+{tail}" if tail else "")


# (implementation, lead shape, V, dtype, mask kind, Pallas block_v or None = the default)
_CPU_TILE_CASES = [
    ("pallas", (2,), 4096 + 37, F32, None, None),  # full default tiles and a tail
    ("pallas", (2,), 8192, F32, "random", None),  # an exact multiple of the tile
    ("pallas", (2,), 8192 + 37, BF16, "random", None),  # full tiles and a tail, masked
    ("pallas", (3,), 513, F32, "mixed", 128),  # small explicit tiles, a tail of 1
    ("pallas", (3,), 512, BF16, "random", 128),  # small explicit tiles, no tail
    ("xla", (2,), 4096 + 37, F32, "random", None),
]
TILE_CASES = [
    *[pytest.param(*case, id=tile_case_id(*case)) for case in _CPU_TILE_CASES],
    # Production sizes: only where Pallas is compiled for real.
    *[pytest.param(impl, lead, v, dtype, mask, None, marks=pytest.mark.gpu,
                   id=f"gpu-{impl}-{lead[0]}x{v}-{dtype_id(dtype)}-mask_{mask}")
      for impl in FAST
      for lead, v, mask in (((8,), 151_936, "random"), ((64,), 32_000, None))
      for dtype in (F32, BF16)],
]


def test_tile_cases_walk_several_full_tiles():
    """The default-tile Pallas cases of test_vocab_tiles walk several full tiles, with
    and without a partial tail, unmasked and masked: still true if the tuned tile size
    changes (their ids are computed from it)."""
    walks = [(mask is not None, *pallas_tiles(v, dtype, mask)[:2])
             for impl, _, v, dtype, mask, block_v in _CPU_TILE_CASES
             if impl == "pallas" and block_v is None]
    assert any(full >= 2 and tail for masked, full, tail in walks if not masked), walks
    assert any(full >= 2 and tail for masked, full, tail in walks if masked), walks
    assert any(full >= 2 and not tail for _, full, tail in walks), walks


@pytest.mark.parametrize("implementation,lead,num_vocab,dtype,mask,block_v", TILE_CASES)
def test_vocab_tiles(implementation, lead, num_vocab, dtype, mask, block_v):
    """V over several tiles, with and without a partial tail, and small explicit tiles."""
    logits, targets, keep_mask = make_inputs(2, lead, num_vocab, dtype, mask=mask, scale=5.0)
    config = interpret_config(block_v=block_v) if block_v else None
    check_against_reference(logits, targets, keep_mask=keep_mask, temperature=0.9,
                            implementation=implementation, pallas_config=config, seed=2)


def check_variant_against_default(logits, targets, keep_mask, variant_flags, default_flags,
                                  *, seed, tolerances):
    """A Pallas kernel variant (`PallasConfig` flags, 128-wide tiles) and the default kernel:
    each against the float64 reference, then against each other to `tolerances[field]`."""
    outs = [check_against_reference(
        logits, targets, keep_mask=keep_mask, temperature=0.9, implementation="pallas",
        pallas_config=interpret_config(block_v=128, **flags), seed=seed)
        for flags in (variant_flags, default_flags)]
    for field, tol in tolerances.items():
        np.testing.assert_allclose(np.asarray(getattr(outs[0], field), np.float32),
                                   np.asarray(getattr(outs[1], field), np.float32),
                                   rtol=tol, atol=tol, err_msg=field)


@pytest.mark.parametrize("order", ["ascending", "descending", "random"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_skip_rescale_variant(order, dtype):
    """`PallasConfig(skip_rescale=True)` and the default kernel against the reference, and
    against each other to fp32 rounding (the compiler may contract the branch's arithmetic
    differently): rows whose max grows in every tile (ascending), only in the first
    (descending) and at random, with a mask and an entropy gradient."""
    logits, targets, keep_mask = make_inputs(4, (3,), 128 * 4 + 37, dtype, mask="mixed",
                                             scale=4.0)
    if order != "random":
        logits = jnp.sort(logits, axis=-1, descending=order == "descending")
    check_variant_against_default(logits, targets, keep_mask, dict(skip_rescale=True),
                                  dict(skip_rescale=False), seed=3,
                                  tolerances={"log_prob": 1e-6, "entropy": 1e-6})


KERNEL_VARIANTS = {"prefetch": dict(prefetch=True), "scalar_sums": dict(scalar_sums=True),
                   "both": dict(prefetch=True, scalar_sums=True)}


@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
@pytest.mark.parametrize("num_vocab", [100, 128, 128 * 2 + 37, 128 * 5, 128 * 5 + 1],
                         ids=lambda v: f"V{v}")
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_kernel_variants(variant, num_vocab, dtype):
    """`PallasConfig(prefetch=True)` (the next tile rides in the loop carry) and
    `scalar_sums=True` (per-tile reductions) against the reference and the default
    kernel: tile counts 0, 1, 2 and 5 (no loop, a loop of one, longer), with and
    without a partial tail; a mask with a row that takes the exact second pass (kept
    logits ~1e4 below an unkept max) and an entropy gradient."""
    logits, targets, keep_mask = make_inputs(5, (5,), num_vocab, dtype, mask="mixed",
                                             scale=4.0)
    far_row = np.zeros(logits.shape, bool)
    far_row[0, np.argmax(~np.asarray(keep_mask[0]))] = True  # one unkept column of row 0
    logits = jnp.where(jnp.asarray(far_row), jnp.asarray(1e4, dtype), logits)
    # Equal up to the order of additions (fp32), and one rounding for bf16 gradients.
    check_variant_against_default(
        logits, targets, keep_mask, KERNEL_VARIANTS[variant], {}, seed=5,
        tolerances={"log_prob": 1e-6, "entropy": 1e-6, "grad": 1e-6 if dtype == F32 else 8e-3})


@pytest.mark.parametrize("itemsize,masked,with_entropy,backward,expected", [
    (2, False, True, False, dict(scalar_sums=True, prefetch=False, block_v=2048)),
    (2, True, True, False, dict(scalar_sums=True, prefetch=False, block_v=1024)),
    (2, False, False, False, dict(scalar_sums=False, prefetch=True, skip_rescale=True)),
    (2, True, False, False, dict(scalar_sums=False, prefetch=True, skip_rescale=False)),
    (2, True, True, True, dict(scalar_sums=False, prefetch=True)),
    (4, False, True, False, dict(scalar_sums=False, prefetch=False)),
    (4, True, False, True, dict(scalar_sums=False, prefetch=False, block_v=1024)),
])
def test_tuned_defaults(itemsize, masked, with_entropy, backward, expected):
    """The defaults docs/performance.md documents ("Triton kernels: tuned defaults");
    explicit fields win."""
    resolved = with_tuned_defaults(jaxops.PallasConfig(), 151_936, masked=masked,
                                   itemsize=itemsize, with_entropy=with_entropy,
                                   backward=backward)
    assert {k: getattr(resolved, k) for k in expected} == expected
    assert (resolved.num_warps, resolved.num_stages) == (4, 2)
    explicit = with_tuned_defaults(
        jaxops.PallasConfig(block_v=512, prefetch=False, scalar_sums=False), 151_936,
        masked=masked, itemsize=itemsize, with_entropy=with_entropy, backward=backward)
    assert (explicit.block_v, explicit.prefetch, explicit.scalar_sums) == (512, False, False)
