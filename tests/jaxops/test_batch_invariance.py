"""The guarantee both Pallas backends give (README "Guarantees"): a row's log-prob,
entropy and gradient are bitwise the same whether the row is alone, in a batch of any
size, at any position, and from one run to the next.

Through the public op (`jaxops.logprob_entropy` under `jax.vjp`), so the wrappers, the
chunk combine and the kernels are all covered. On the GPU at the sizes users run
(T = 8192, V = 151,936 and one TP = 8 shard, V_loc = 18,992); on CPU the same checks
in interpret mode at small sizes, which pin the wrappers' row handling only (the
kernels' arithmetic order is the GPU's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxops
from jaxops.backends.mosaic.config import MosaicConfig
from jaxops.backends.triton.config import PallasConfig

F32, BF16 = jnp.float32, jnp.bfloat16


def _inputs(num_tokens, num_vocab, dtype, masked, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    logits = (jax.random.normal(keys[0], (num_tokens, num_vocab), F32) * 3).astype(dtype)
    targets = jax.random.randint(keys[1], (num_tokens,), 0, num_vocab)
    mask = None
    if masked:  # uint8: the form both backends read without a conversion pass
        mask = jax.random.bernoulli(keys[2], 0.05, (num_tokens, num_vocab)).astype(jnp.uint8)
    g_lp = jax.random.normal(keys[3], (num_tokens,), F32)
    g_h = jax.random.normal(keys[4], (num_tokens,), F32)
    return logits, targets, mask, g_lp, g_h


def _runner(implementation, config):
    @jax.jit
    def run(logits, targets, mask, g_lp, g_h):
        def f(x):
            return jaxops.logprob_entropy(x, targets, keep_mask=mask, temperature=0.8,
                                          implementation=implementation,
                                          pallas_config=config)
        (log_prob, entropy), vjp = jax.vjp(f, logits)
        (grad,) = vjp((g_lp, g_h))
        return log_prob, entropy, grad
    return run


def check_batch_invariance(implementation, config, num_tokens, num_vocab, dtype, masked,
                           rows, batches):
    """Each of `rows`, in the full batch, alone, and at position 3 of batches of each
    size in `batches` (its neighbours other rows of the same inputs), bitwise; and the
    full batch twice."""
    inputs = _inputs(num_tokens, num_vocab, dtype, masked)
    run = _runner(implementation, config)
    full = jax.device_get(run(*inputs))
    again = jax.device_get(run(*inputs))
    for name, a, b in zip(("log_prob", "entropy", "grad"), full, again):
        np.testing.assert_array_equal(a, b, err_msg=f"{name}: run to run")

    def take(idx):
        return [None if a is None else a[idx] for a in inputs]

    for row in rows:
        for size in (1, *batches):
            others = np.array([r for r in range(num_tokens) if r != row][:size - 1], np.int64)
            idx = np.insert(others, min(3, size - 1), row)
            pos = int(np.nonzero(idx == row)[0][0])
            got = jax.device_get(run(*take(idx)))
            for name, a, b in zip(("log_prob", "entropy", "grad"), got, full):
                np.testing.assert_array_equal(
                    a[pos], b[row], err_msg=f"{name}: row {row} in a batch of {size}")


BACKENDS_GPU = [("pallas_triton", None), ("pallas_mosaic", None)]


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_vocab", [18992, 151936])
@pytest.mark.parametrize("implementation,config", BACKENDS_GPU, ids=["triton", "mosaic"])
def test_gpu_batch_invariance(implementation, config, num_vocab, dtype, masked):
    check_batch_invariance(implementation, config, 8192, num_vocab, dtype, masked,
                           rows=(0, 4097, 8191), batches=(7, 100))


# Interpret mode: small sizes that still span several row blocks and vocabulary
# tiles/chunks (Mosaic: 64-row blocks, chunks of 512 columns here; Triton: 256-column
# tiles), with partial last ones.
BACKENDS_CPU = [("pallas_triton", PallasConfig(interpret=True, block_v=256)),
                ("pallas_mosaic", MosaicConfig(interpret=True, chunk_v=512))]


@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("implementation,config", BACKENDS_CPU, ids=["triton", "mosaic"])
def test_batch_invariance_interpret(implementation, config, masked):
    check_batch_invariance(implementation, config, 70, 1360, F32, masked,
                           rows=(0, 66), batches=(7,))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("implementation,config", BACKENDS_GPU, ids=["triton", "mosaic"])
def test_gpu_far_kept_maximum_leaves_neighbours_alone(implementation, config, dtype):
    """A row whose keep mask leaves out its maximum by far (the Mosaic kernels take a
    second exponential for it) next to ordinary rows: theirs stay bitwise the same."""
    num_tokens, num_vocab = 256, 151936
    logits, targets, mask, g_lp, g_h = _inputs(num_tokens, num_vocab, dtype, True)
    mask = mask.at[:, 0].set(0)
    logits = logits.at[1, 0].set(200.0)  # 200 / 0.8 nats above every kept logit of row 1
    inputs = (logits, targets, mask, g_lp, g_h)
    run = _runner(implementation, config)
    full = jax.device_get(run(*inputs))
    for row in (0, 2, 63, 200):
        alone = jax.device_get(run(*[a[row:row + 1] for a in inputs]))
        for name, a, b in zip(("log_prob", "entropy", "grad"), alone, full):
            np.testing.assert_array_equal(a[0], b[row], err_msg=f"{name}: row {row}")
