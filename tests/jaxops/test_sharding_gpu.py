"""Vocab-parallel op on GPUs (skipped without one).

- One GPU: every sharding mode on a 1-device mesh, compiled Pallas (Triton) and
  XLA, against the unsharded op and the float64 reference. This is where
  `check_vma=True` with compiled Pallas kernels is exercised (interpret mode on
  CPU cannot run under it).
- Two or more GPUs: the same on 2, 4 and 8 shards as far as the machine has
  GPUs, plus the collectives in the compiled forward and gradient.

    PYTHONPATH=. python3 -m pytest -q tests/jaxops/test_sharding_gpu.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from _sharding_cases import (
    CONFIGS,
    MODES,
    check_against_references,
    collectives,
    config_inputs,
    expected64,
    make_datasets,
    mesh_1d,
    run_all_configs,
    sharded_fn,
    value_and_vjp,
    vocab_spec,
)

pytestmark = pytest.mark.gpu

SHAPE = (16, 16)  # T = 256 tokens
VOCAB = 8000  # 1, 2, 4, 8 shards: V_loc = 8000, 4000, 2000, 1000, none a power of two
IMPLEMENTATIONS = ("pallas", "xla")


@pytest.fixture(scope="module")
def cases():
    datasets = make_datasets(SHAPE, VOCAB)
    references = [{name: expected64(d, cfg) for name, cfg in CONFIGS.items()}
                  for d in datasets]
    unsharded = {impl: run_all_configs("plain_jit", impl, None, datasets, CONFIGS)
                 for impl in IMPLEMENTATIONS}
    return datasets, references, unsharded


def _check(cases, implementation, mode, num_shards):
    datasets, references, unsharded = cases
    label = f"{implementation} {mode} shards={num_shards}"
    results = run_all_configs(mode, implementation, mesh_1d(num_shards), datasets, CONFIGS)
    worst = check_against_references(label, results, unsharded[implementation], references,
                                     datasets, CONFIGS, unsharded_value_tol=1e-5)
    print(f"\n{label}: worst gradient error vs float64 {worst}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_one_gpu_mesh(cases, implementation, mode):
    _check(cases, implementation, mode, 1)


@pytest.mark.parametrize("num_shards", [2, 4, 8])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_multi_gpu(cases, implementation, mode, num_shards):
    if jax.device_count() < num_shards:
        pytest.skip(f"needs {num_shards} GPUs, have {jax.device_count()}")
    _check(cases, implementation, mode, num_shards)


def _compiled_collectives(mode, implementation, mesh, name="mask_tau"):
    data = make_datasets(SHAPE, VOCAB)[0]
    cfg = CONFIGS[name]
    logits, mask = config_inputs(data, cfg)
    if mode in ("wrapper", "plain_jit"):
        sharding = NamedSharding(mesh, vocab_spec(logits.ndim))
        logits, mask = jax.device_put(logits, sharding), jax.device_put(mask, sharding)
    targets = jnp.asarray(data["targets"])
    cts = (jnp.asarray(data["d_log_prob"]), jnp.asarray(data["d_entropy"]))
    fn = sharded_fn(mode, cfg, implementation, mesh, logits.ndim)
    forward = collectives(jax.jit(fn).lower(logits, targets, mask).compile().as_text())
    both = collectives(jax.jit(lambda x, t, m, a, b: value_and_vjp(fn, x, t, m, a, b))
                       .lower(logits, targets, mask, *cts).compile().as_text())
    return forward, both


@pytest.mark.parametrize("mode", ["shard_map_vma", "shard_map_novma", "wrapper"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_collectives_on_gpus(implementation, mode):
    """Forward: at most 2 all-reduces of O(T); backward: none with check_vma=True
    (the wrapper uses it for compiled Pallas), one with check_vma=False."""
    num_shards = min(jax.device_count(), 8)
    num_tokens = int(np.prod(SHAPE))
    mesh = mesh_1d(num_shards)
    forward, both = _compiled_collectives(mode, implementation, mesh)
    print(f"\n{implementation} {mode} shards={num_shards}: forward {forward}, "
          f"forward+backward {both}")
    for op, size in forward + both:
        assert op == "all-reduce" and size <= 6 * num_tokens, (forward, both)
    if num_shards == 1:
        return  # a 1-device mesh needs no collective; the sizes above still hold
    assert len(forward) <= 2, forward
    assert len(both) - len(forward) == (0 if mode != "shard_map_novma" else 1), (forward, both)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_plain_jit_collectives_reported(implementation):
    """`jax.jit(logprob_entropy)` on vocab-sharded arrays: correct (tested above), but
    XLA cannot partition a pallas_call; this prints what it does instead."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    mesh = mesh_1d(min(jax.device_count(), 8))
    forward, both = _compiled_collectives("plain_jit", implementation, mesh)
    print(f"\nplain jit {implementation}: forward {forward}, forward+backward {both}")
