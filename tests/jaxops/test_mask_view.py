"""Bool keep masks handed to the Mosaic GPU kernels as bytes, in place (`jaxops/mask_view.py`).

Off-GPU: the view's own semantics (eager it converts; under jit any consumer other than
a kernel fails to lower or converts the same 0/1 values), and the statistics and fused
head kernels lowered for CUDA with a bool mask: with `mask_view.ENABLED` the Mosaic
custom call takes the bool operand itself (no uint8 copy in the program), without it a
converted uint8 one; the choice of backend for "pallas" follows the switch.

On a GPU (`gpu` marker), with the switch on: every kernel given a bool mask returns
bitwise what it returns given the same mask as uint8 (same kernel, same bytes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxops.backends import registry
from jaxops.backends.mosaic import mask_view
from jaxops.contract import BackwardCoefs

from _mosaic_cases import inputs as mosaic_inputs  # logits, targets, a "mixed" keep mask

mosaic_kernels = pytest.importorskip("jaxops.backends.mosaic.kernels")

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct


# --- the view itself --------------------------------------------------------------------

def _mask(shape=(6, 40), seed=0):
    return jnp.asarray(np.random.default_rng(seed).random(shape) < 0.4)


def test_outside_jit_it_converts():
    mask = _mask()
    view = mask_view.bytes_view(mask)
    assert view.dtype == jnp.uint8
    np.testing.assert_array_equal(view, np.asarray(mask).astype(np.uint8))
    np.testing.assert_array_equal(jax.vmap(mask_view.bytes_view)(mask), view)


def test_refuses_masks_that_are_not_bool():
    with pytest.raises(TypeError, match="bool"):
        mask_view.bytes_view(jnp.zeros((2, 16), jnp.uint8))


@pytest.mark.parametrize("misuse", [
    lambda m: mask_view.bytes_view(m),  # a jit output
    lambda m: mask_view.bytes_view(m) + 1,
    lambda m: mask_view.bytes_view(m) != 0,
    lambda m: mask_view.bytes_view(m)[1:3],
    lambda m: jnp.where(mask_view.bytes_view(m) > 0, 1.0, 2.0),
], ids=["output", "add", "compare", "slice", "where"])
def test_other_consumers_fail_to_lower(misuse):
    """Only a kernel may read the view: anything else sees an i1 value typed ui8, and
    MLIR's verifier rejects the program instead of computing with it."""
    with pytest.raises(ValueError, match="verifier"):
        jax.jit(misuse).lower(_mask())


def test_a_convert_reads_the_same_values():
    mask = _mask()
    got = jax.jit(lambda m: mask_view.bytes_view(m).astype(jnp.float32))(mask)
    np.testing.assert_array_equal(got, np.asarray(mask).astype(np.float32))


# --- lowered for CUDA: where the mask goes -------------------------------------------------

def _kernel_operand_types(text: str) -> list[str]:
    """The operand types of each Mosaic GPU custom call in lowered StableHLO text."""
    calls = [line for line in text.splitlines() if "mosaic_gpu_v2" in line]
    assert calls, "no Mosaic GPU kernel in the program (an XLA fallback?)"
    return [line.rsplit(" : (", 1)[1].split(") ->")[0] for line in calls]


def _lowered(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _check_mask_operands(text: str, shape: tuple[int, ...], in_place: bool):
    """Each kernel's mask operand: the bool array itself (in place) or a uint8 one."""
    dims = "x".join(map(str, shape))
    mask_bool, mask_bytes = f"{dims}xi1", f"{dims}xui8"
    for types in _kernel_operand_types(text):
        assert (mask_bool in types) == in_place, types
        assert (mask_bytes in types) == (not in_place), types


@pytest.mark.parametrize("in_place", [False, True], ids=["converted", "in_place"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_statistics_kernels_take_the_bool_mask(monkeypatch, in_place, dtype):
    monkeypatch.setattr(mask_view, "ENABLED", in_place)
    num_tokens, num_vocab = 1024, 151936
    logits, mask = S((num_tokens, num_vocab), dtype), S((num_tokens, num_vocab), jnp.bool_)
    targets, row = S((num_tokens,), jnp.int32), S((num_tokens,), F32)
    fwd = functools.partial(mosaic_kernels.forward_stats, inv_tau=1 / 0.7, with_entropy=True)
    bwd = functools.partial(mosaic_kernels.backward_logits, inv_tau=1 / 0.7)
    _check_mask_operands(_lowered(fwd, logits, targets, mask), mask.shape, in_place)
    _check_mask_operands(_lowered(bwd, logits, targets, mask, row, row,
                                  BackwardCoefs(row, row, row, row)), mask.shape, in_place)


@pytest.mark.parametrize("in_place", [False, True], ids=["converted", "in_place"])
def test_gradient_takes_the_saved_bool_mask(monkeypatch, in_place):
    """Through the statistics' custom VJP (`stats.local_stats`, as the public op runs the
    kernels): the bool mask saved for the backward reaches the backward kernel as it
    came. (The public op itself runs the interpreter off-GPU: see the GPU test below.)"""
    from jaxops import stats
    from jaxops.backends.mosaic.config import MosaicConfig

    monkeypatch.setattr(mask_view, "ENABLED", in_place)
    num_tokens, num_vocab = 512, 151936

    def loss(x, t, m):
        out = stats.local_stats(x, t, m, 1 / 0.7, True, True, "pallas_mosaic",
                                MosaicConfig())
        return (out.sum_exp_shifted / out.sum_exp + out.masked_sum_exp).sum()

    text = _lowered(jax.grad(loss), S((num_tokens, num_vocab), BF16),
                    S((num_tokens,), jnp.int32), S((num_tokens, num_vocab), jnp.bool_))
    assert len(_kernel_operand_types(text)) == 2  # forward, backward
    _check_mask_operands(text, (num_tokens, num_vocab), in_place)


@settings(max_examples=10, deadline=None)
@given(num_tokens=st.integers(1, 20000), vocab_units=st.integers(1, 12000),
       dtype=st.sampled_from([F32, BF16]), with_entropy=st.booleans())
def test_in_place_at_random_shapes(num_tokens, vocab_units, dtype, with_entropy):
    """Any T and any V_loc the masked kernels take (multiples of 16): both kernels read
    the bool operand itself, whether their tiles move tiled or untiled."""
    num_vocab = 16 * vocab_units
    logits, mask = S((num_tokens, num_vocab), dtype), S((num_tokens, num_vocab), jnp.bool_)
    targets, row = S((num_tokens,), jnp.int32), S((num_tokens,), F32)
    fwd = functools.partial(mosaic_kernels.forward_stats, inv_tau=1 / 0.7,
                            with_entropy=with_entropy)
    bwd = functools.partial(mosaic_kernels.backward_logits, inv_tau=1 / 0.7)
    coefs = BackwardCoefs(row, row if with_entropy else None, row, row)
    with pytest.MonkeyPatch.context() as patch:  # not the fixture: hypothesis reruns the body
        patch.setattr(mask_view, "ENABLED", True)
        _check_mask_operands(_lowered(fwd, logits, targets, mask), mask.shape, True)
        _check_mask_operands(_lowered(bwd, logits, targets, mask, row, row, coefs),
                             mask.shape, True)


def test_fused_head_kernels_take_the_bool_mask(monkeypatch):
    """The fused head's statistics (in row groups at T = 8192: each group's rows of the
    bool mask go in place) and its backward kernel on one chunk."""
    from jaxops.backends.mosaic import linear as mosaic_linear

    monkeypatch.setattr(mask_view, "ENABLED", True)
    fwd = functools.partial(mosaic_linear.forward_stats, inv_tau=1 / 0.7, with_entropy=True)
    text = _lowered(fwd, S((8192, 4096), BF16), S((151936, 4096), BF16),
                    S((8192,), jnp.int32), S((8192, 151936), jnp.bool_))
    assert len(_kernel_operand_types(text)) == 8192 // mosaic_linear.ROW_GROUP
    _check_mask_operands(text, (mosaic_linear.ROW_GROUP, 151936), in_place=True)

    vec = S((4096,), F32)
    bwd = functools.partial(mosaic_linear.backward_logits, inv_tau=1 / 0.7)
    text = _lowered(bwd, S((4096, 4096), BF16), S((4096, 4096), BF16), S((4096,), jnp.int32),
                    vec, BackwardCoefs(vec, vec, vec, vec), S((4096, 4096), jnp.bool_), vec)
    _check_mask_operands(text, (4096, 4096), in_place=True)


@pytest.mark.parametrize("fused_forward, fused_backward", [(False, False), (False, True),
                                                           (True, False), (True, True)])
def test_fused_head_op_takes_the_bool_mask(monkeypatch, fused_forward, fused_backward):
    """The fused head's statistics and their VJP as the op runs them: the vocabulary's
    chunks in a scan (each chunk's slice of the mask goes in place into the statistics
    or the fused backward kernel) or the fused forward on the whole mask."""
    from jaxops import linear
    from jaxops.backends.mosaic.config import MosaicConfig

    monkeypatch.setattr(mask_view, "ENABLED", True)
    num_tokens, hidden_size, num_vocab, chunk = 1024, 512, 32768, 4096

    def loss(h, w, t, m):
        out = linear.linear_local_stats(h, w, t, m, 1 / 0.7, True, True, "pallas_mosaic",
                                         MosaicConfig(), chunk, fused_forward,
                                         fused_backward)
        return (out.sum_exp_shifted / out.sum_exp + out.masked_sum_exp).sum()

    text = _lowered(jax.grad(loss, argnums=(0, 1)), S((num_tokens, hidden_size), BF16),
                    S((num_vocab, hidden_size), BF16), S((num_tokens,), jnp.int32),
                    S((num_tokens, num_vocab), jnp.bool_))
    forward, backward = _kernel_operand_types(text)
    whole = f"{num_tokens}x{num_vocab if fused_forward else chunk}xi1"
    assert whole in forward and "xui8" not in forward, forward
    assert f"{num_tokens}x{chunk}xi1" in backward and "xui8" not in backward, backward


def test_in_place_under_shard_map(monkeypatch):
    """Vocab-parallel (`shard_map`, vma checked): the view keeps the mask's varying axes."""
    from jax.sharding import PartitionSpec as P

    monkeypatch.setattr(mask_view, "ENABLED", True)
    mesh = jax.make_mesh((1,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])
    num_tokens, num_vocab = 256, 151936

    def stats(x, t, m):
        out = mosaic_kernels.forward_stats(x, t, m, inv_tau=1.0, with_entropy=True)
        return out.max_logit, out.masked_sum_exp

    sharded = jax.shard_map(stats, mesh=mesh, in_specs=(P(None, "tp"), P(), P(None, "tp")),
                            out_specs=(P("tp"), P("tp")), check_vma=True)
    text = _lowered(sharded, S((num_tokens, num_vocab), BF16), S((num_tokens,), jnp.int32),
                    S((num_tokens, num_vocab), jnp.bool_))
    _check_mask_operands(text, (num_tokens, num_vocab), in_place=True)


def test_in_place_under_vmap(monkeypatch):
    """vmap with the batch on a non-leading axis: the view's batching rule moves the axis
    on the bool side, so the kernel's batching rule has nothing to move on the view
    (which would be a transpose of it: a program that fails to lower)."""
    monkeypatch.setattr(mask_view, "ENABLED", True)
    batch, num_tokens, num_vocab = 2, 64, 18992
    stats = jax.vmap(lambda x, t, m: mosaic_kernels.forward_stats(
        x, t, m, inv_tau=1.0, with_entropy=True).max_logit, in_axes=1)
    text = _lowered(stats, S((num_tokens, batch, num_vocab), BF16),
                    S((num_tokens, batch), jnp.int32),
                    S((num_tokens, batch, num_vocab), jnp.bool_))
    _check_mask_operands(text, (batch, num_tokens, num_vocab), in_place=True)


@pytest.mark.parametrize("enabled, want", [(False, "pallas_triton"), (True, "pallas_mosaic")])
def test_pallas_routes_bool_masks_by_the_switch(monkeypatch, enabled, want):
    monkeypatch.setattr(mask_view, "ENABLED", enabled)
    assert registry.pallas_backend(151936, 2, np.bool_, (9, 0)) == want
    assert registry.pallas_backend(151936, 2, np.uint8, (9, 0)) == "pallas_mosaic"


# --- on the GPU ---------------------------------------------------------------------------

def _coefs(num_tokens, seed):
    keys = jax.random.split(jax.random.key(seed), 4)
    return BackwardCoefs(*[jax.random.normal(k, (num_tokens,), F32) for k in keys])


def _assert_trees_equal(got, want):
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_tokens, num_vocab", [(1, 151936), (1000, 18992),
                                                   (8192, 151936)])
def test_gpu_bool_in_place_is_bitwise_uint8(monkeypatch, num_tokens, num_vocab, dtype):
    monkeypatch.setattr(mask_view, "ENABLED", True)
    logits, targets, mask = mosaic_inputs(0, num_tokens, num_vocab, dtype, "mixed")
    targets = targets.at[0].set(num_vocab + 5).astype(jnp.int32)  # row 0: target elsewhere
    coefs = _coefs(num_tokens, 1)

    @jax.jit
    def run(x, t, m, c):
        stats = mosaic_kernels.forward_stats(x, t, m, inv_tau=1 / 0.8, with_entropy=True)
        return stats, mosaic_kernels.backward_logits(x, t, m, stats.max_logit,
                                                    stats.masked_max, c, inv_tau=1 / 0.8)

    text = run.trace(logits, targets, mask, coefs).lower().as_text()
    _check_mask_operands(text, mask.shape, in_place=True)
    _assert_trees_equal(run(logits, targets, mask, coefs),
                        run(logits, targets, mask.astype(jnp.uint8), coefs))


@pytest.mark.gpu
def test_gpu_public_op_bool_in_place_is_bitwise_uint8(monkeypatch):
    """"pallas" with a bool mask (now the Mosaic kernels), values and gradient: the
    mask saved for the backward reaches its kernel in place too. (Off-GPU the public op
    runs the interpreter, so this path is lowered for CUDA only here.)"""
    import jaxops

    monkeypatch.setattr(mask_view, "ENABLED", True)
    logits, targets, mask = mosaic_inputs(1, 4096, 151936, BF16, "mixed")

    @jax.jit
    def run(x, t, m):
        def loss(x):
            log_prob, entropy = jaxops.logprob_entropy(x, t, keep_mask=m, temperature=0.8,
                                                       implementation="pallas")
            return (log_prob - 0.3 * entropy).sum(), (log_prob, entropy)
        return jax.grad(loss, has_aux=True)(x)

    _check_mask_operands(run.trace(logits, targets, mask).lower().as_text(), mask.shape,
                         in_place=True)
    _assert_trees_equal(run(logits, targets, mask), run(logits, targets, mask.astype(jnp.uint8)))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1024, 8192])
def test_gpu_fused_head_bool_in_place_is_bitwise_uint8(monkeypatch, num_tokens):
    from jaxops.backends.mosaic import linear as mosaic_linear

    monkeypatch.setattr(mask_view, "ENABLED", True)
    k = jax.random.split(jax.random.key(2), 3)
    hidden = jax.random.normal(k[0], (num_tokens, 512), F32).astype(BF16)
    weight = (jax.random.normal(k[1], (32768, 512), F32) / 16).astype(BF16)
    _, targets, mask = mosaic_inputs(3, num_tokens, 32768, BF16, "mixed")
    targets = targets.at[0].set(32768 + 5).astype(jnp.int32)  # row 0: target elsewhere
    coefs = _coefs(num_tokens, 4)

    @jax.jit
    def run(h, w, t, m, c):
        stats = mosaic_linear.forward_stats(h, w, t, m, inv_tau=1 / 0.8, with_entropy=True)
        return stats, mosaic_linear.backward_logits(h, w, t, stats.max_logit, c, m,
                                                    stats.masked_max, inv_tau=1 / 0.8)

    _assert_trees_equal(run(hidden, weight, targets, mask, coefs),
                        run(hidden, weight, targets, mask.astype(jnp.uint8), coefs))
