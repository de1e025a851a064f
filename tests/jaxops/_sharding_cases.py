"""Shared pieces of the vocab-parallel tests: configurations, scenarios, the ways
a JAX user shards, comparisons, and an HLO collective counter.

No side effects at import: used by tests/jaxops/_sharding_worker.py (fake CPU devices,
in a subprocess) and tests/jaxops/test_sharding_gpu.py (real GPUs).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxops
from _oracle import VALUE_RTOL, assert_grad_close, assert_values_close, reference64, value_bound

# Every option of the core op appears in at least one configuration: keep_mask
# on/off, temperature 1 and not, entropy off / on with its gradient / on without,
# float32, bfloat16 and float16 logits.
CONFIGS = {
    "plain": dict(dtype=jnp.float32, mask=False, temperature=1.0, with_entropy=True,
                  entropy_grad=True),
    "mask_tau": dict(dtype=jnp.float32, mask=True, temperature=0.7, with_entropy=True,
                     entropy_grad=True),
    "f16_nogradH": dict(dtype=jnp.float16, mask=False, temperature=1.3, with_entropy=True,
                        entropy_grad=False),
    "bf16_mask_noH": dict(dtype=jnp.bfloat16, mask=True, temperature=0.7, with_entropy=False,
                          entropy_grad=True),
}

SCENARIOS = ("spread", "one", "absent")
VOCAB_AXIS = "tp"


# ----------------------------------------------------------------------------- data

def make_data(kind: str, seed: int, shape: tuple, num_vocab: int):
    """Logits (float32), targets, keep mask and cotangents for one scenario.

    kind:
      spread  random targets anywhere, random masks.
      one     every target in the first 1/8 of the vocabulary (one shard, for any
              shard count up to 8); masks keeping nothing on most shards, or nothing
              at all (rows 5..7: log_prob exactly 0); row 0 has its maximum +50 on
              the first shard and its kept logits and target around -60, 110 below
              (exp(-110) underflows float32: the masked sum needs its own maximum).
      absent  targets only in the first and last 1/8 (absent from the middle
              shards); rows whose mask keeps nothing; large-magnitude rows.
    """
    rng = np.random.default_rng(seed)
    num_tokens = int(np.prod(shape))
    assert num_tokens >= 8 and num_vocab >= 16
    eighth = num_vocab // 8
    logits = rng.normal(0.0, 2.0, (num_tokens, num_vocab)).astype(np.float32)
    mask = rng.random((num_tokens, num_vocab)) < 0.3
    if kind == "spread":
        targets = rng.integers(0, num_vocab, num_tokens)
    elif kind == "one":
        targets = rng.integers(0, eighth, num_tokens)
        mask[:] = False
        mask[0:3, -eighth:] = rng.random((3, eighth)) < 0.5  # kept only on the last shard
        mask[3:5, :eighth] = True  # kept only on the target's shard
        mask[8:] = rng.random((num_tokens - 8, num_vocab)) < 0.3
        logits[0] = rng.normal(-60.0, 1.0, num_vocab)
        logits[0, 2] = 50.0
        targets[0] = num_vocab - 3
        mask[0, -eighth:] = True
    elif kind == "absent":
        first = rng.integers(0, eighth, num_tokens)
        last = rng.integers(num_vocab - eighth, num_vocab, num_tokens)
        targets = np.where(np.arange(num_tokens) % 2 == 0, first, last)
        mask[::3] = False
        logits[1] = logits[1] * 10.0 + 25.0  # |x| up to ~55, large spread
        logits[2] = logits[2] - 40.0
    else:
        raise ValueError(kind)
    weights = rng.normal(0.0, 1.0, (2, num_tokens)).astype(np.float32)
    return dict(
        logits=logits.reshape(shape + (num_vocab,)),
        targets=targets.astype(np.int32).reshape(shape),
        mask=mask.reshape(shape + (num_vocab,)),
        d_log_prob=weights[0].reshape(shape),
        d_entropy=weights[1].reshape(shape),
    )


def make_datasets(shape, num_vocab):
    return [make_data(kind, seed, shape, num_vocab) for seed, kind in enumerate(SCENARIOS)]


def config_inputs(data, cfg):
    """(logits in the config's dtype, mask or None)."""
    logits = jnp.asarray(data["logits"]).astype(cfg["dtype"])
    return logits, (jnp.asarray(data["mask"]) if cfg["mask"] else None)


def op_options(cfg, implementation, pallas_config=None):
    return dict(temperature=cfg["temperature"], with_entropy=cfg["with_entropy"],
                entropy_grad=cfg["entropy_grad"], implementation=implementation,
                pallas_config=pallas_config if implementation == "pallas" else None)


# ------------------------------------------------------------------ ways to shard

MODES = ("shard_map_vma", "shard_map_novma", "wrapper", "plain_jit")


def mesh_1d(num_shards: int):
    return jax.make_mesh((num_shards,), (VOCAB_AXIS,), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:num_shards])


def vocab_spec(ndim):
    return P(*(None,) * (ndim - 1), VOCAB_AXIS)


def user_shard_map(cfg, implementation, mesh, check_vma, ndim, pallas_config=None):
    """What a user writes: their own shard_map, logits [..., V_loc] per device."""
    spec = vocab_spec(ndim)

    def per_shard(logits, targets, mask):
        return jaxops.logprob_entropy(logits, targets, keep_mask=mask, axis_name=VOCAB_AXIS,
                                      **op_options(cfg, implementation, pallas_config))

    return jax.shard_map(
        per_shard, mesh=mesh, check_vma=check_vma,
        in_specs=(spec, P(), spec if cfg["mask"] else None),
        out_specs=(P(), P() if cfg["with_entropy"] else None))


def sharded_fn(mode, cfg, implementation, mesh, ndim, pallas_config=None):
    """f(logits, targets, mask) -> (log_prob, entropy) in one of the sharding modes:

    shard_map_vma / shard_map_novma  the user's shard_map, check_vma True / False;
    wrapper                          jaxops.vocab_parallel_logprob_entropy on global arrays;
    plain_jit                        jaxops.logprob_entropy on global (vocab-sharded) arrays.
    """
    options = op_options(cfg, implementation, pallas_config)
    if mode == "shard_map_vma":
        return user_shard_map(cfg, implementation, mesh, True, ndim, pallas_config)
    if mode == "shard_map_novma":
        return user_shard_map(cfg, implementation, mesh, False, ndim, pallas_config)
    if mode == "wrapper":
        return lambda x, y, m: jaxops.vocab_parallel_logprob_entropy(
            x, y, keep_mask=m, mesh=mesh, vocab_axis=VOCAB_AXIS, **options)
    if mode == "plain_jit":
        return lambda x, y, m: jaxops.logprob_entropy(x, y, keep_mask=m, **options)
    raise ValueError(mode)


def value_and_vjp(fn, logits, targets, mask, d_log_prob, d_entropy):
    """(log_prob, entropy, d logits) for the cotangents (d_log_prob, d_entropy)."""
    (log_prob, entropy), pullback = jax.vjp(lambda x: fn(x, targets, mask), logits)
    (grad,) = pullback((d_log_prob, None if entropy is None else d_entropy))
    return log_prob, entropy, grad


def run_all_configs(mode, implementation, mesh, datasets, configs, pallas_config=None):
    """One compiled function per (mode, mesh) evaluating every config on every dataset.

    In the modes that take global arrays, logits and masks are placed with a
    NamedSharding over the vocabulary, as a JAX user's arrays would be.
    """
    ndim = datasets[0]["logits"].ndim
    fns = {name: sharded_fn(mode, cfg, implementation, mesh, ndim, pallas_config)
           for name, cfg in configs.items()}

    @jax.jit
    def run(inputs):
        return {name: value_and_vjp(fns[name], *inputs[name]) for name in fns}

    def place_vocab(a):
        return a

    if mode in ("wrapper", "plain_jit") and mesh is not None:
        def place_vocab(a):
            return jax.device_put(a, NamedSharding(mesh, vocab_spec(ndim)))

    results = []
    for data in datasets:
        inputs = {}
        for name, cfg in configs.items():
            logits, mask = config_inputs(data, cfg)
            inputs[name] = (place_vocab(logits), jnp.asarray(data["targets"]),
                            None if mask is None else place_vocab(mask),
                            jnp.asarray(data["d_log_prob"]), jnp.asarray(data["d_entropy"]))
        out = run(inputs)
        if mode == "wrapper" and mesh is not None and mesh.size > 1:
            # The gradient stays vocab-sharded: nothing was gathered on the way out.
            for name in configs:
                spec = tuple(out[name][2].sharding.spec)
                assert len(spec) == ndim and spec[-1] == VOCAB_AXIS, (name, spec)
        results.append(jax.device_get(out))
    return results


# ------------------------------------------------------------------ expectations

def expected64(data, cfg):
    """(log_prob, entropy, d logits) of the float64 reference (tests/_oracle.py) on the
    same input values, for the config's flags: no entropy, or an entropy without
    gradient (its cotangent reaches nothing)."""
    logits, mask = config_inputs(data, cfg)
    shape = data["targets"].shape
    flat = (-1, logits.shape[-1])
    d_entropy = data["d_entropy"] if cfg["with_entropy"] and cfg["entropy_grad"] else (
        np.zeros_like(data["d_entropy"]))
    log_prob, entropy, grad = jax.device_get(reference64(
        np.asarray(logits.astype(jnp.float32)).reshape(flat), data["targets"].reshape(-1),
        None if mask is None else np.asarray(mask).reshape(flat),
        data["d_log_prob"].reshape(-1), d_entropy.reshape(-1),
        temperature=cfg["temperature"]))
    return (log_prob.reshape(shape), entropy.reshape(shape) if cfg["with_entropy"] else None,
            grad.reshape(logits.shape))


def compare(label, got, want, data, cfg, value_rtol=VALUE_RTOL, grad_rtol=None):
    """Values: |err| <= value_rtol * max(1, max|x| of the row); gradients: relative norm
    <= grad_rtol (default: the tolerance table of tests/_oracle.py for the config's dtype).

    Returns the gradient's relative error.
    """
    log_prob, entropy, grad = got
    want_lp, want_h, want_g = want
    bound = value_bound(data["logits"], cfg["temperature"], rtol=value_rtol)
    assert np.dtype(log_prob.dtype) == np.float32, (label, log_prob.dtype)
    assert_values_close(f"{label}: log_prob", log_prob, want_lp, bound)
    if cfg["with_entropy"]:
        assert entropy is not None, (label, "entropy is None")
        assert_values_close(f"{label}: entropy", entropy, want_h, bound)
    else:
        assert entropy is None, (label, "entropy should be None")
    return assert_grad_close(grad, want_g, cfg["dtype"], rtol=grad_rtol,
                             name=f"{label}: gradient")


def check_against_references(label, results, unsharded_results, references, datasets,
                             configs, unsharded_value_tol=2e-6):
    """Sharded results vs the unsharded op (same implementation) and vs float64.

    Returns the worst gradient error vs float64 per config.
    """
    worst = {}
    for index, data in enumerate(datasets):
        for name, cfg in configs.items():
            got = results[index][name]
            where = f"{label} config={name} data={SCENARIOS[index]}"
            # Against the unsharded op: equal up to the order of additions (and, for
            # low-precision gradients, one rounding).
            compare(where + " vs unsharded", got, unsharded_results[index][name], data, cfg,
                    value_rtol=unsharded_value_tol)
            rel = compare(where + " vs float64", got, references[index][name], data, cfg)
            worst[name] = max(worst.get(name, 0.0), rel)
            if cfg["mask"] and SCENARIOS[index] == "one":
                lp = np.asarray(got[0]).reshape(-1)
                assert np.all(np.abs(lp[5:8]) <= 1e-6), (where, "target-only rows", lp[5:8])
    return worst


# ------------------------------------------------------------------ HLO

_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|\S+)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
    r"(?P<start>-start)?\(")
_ARRAY = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")


def collectives(hlo_text: str):
    """[(op, elements)] for every cross-device collective in compiled HLO text.

    Counts all-reduce, all-gather, reduce-scatter, collective-permute and
    all-to-all (their async `-start` forms once, not the `-done`); the size is the
    total number of elements of the result (summed over a tuple result).
    """
    found = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if not match:
            continue
        sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
                 for dims in _ARRAY.findall(match["shape"])]
        found.append((match["op"], int(sum(sizes))))
    return found


PARSER_SELF_TEST = """
  %all-reduce.1 = f32[2,8]{1,0} all-reduce(f32[2,8]{1,0} %x), replica_groups={{0,1}}
  %ag = bf16[8,120]{1,0} all-gather-start(bf16[8,30]{1,0} %y), dimensions={1}
  %agd = bf16[8,120]{1,0} all-gather-done(bf16[8,120]{1,0} %ag)
  %rs = (f32[4]{0}, f32[4]{0}) reduce-scatter(f32[16]{0} %a, f32[16]{0} %b)
  %cp = s32[8]{0} collective-permute(s32[8]{0} %t), source_target_pairs={{0,1}}
  %a2a = f32[8,8]{1,0} all-to-all(f32[8,8]{1,0} %u), dimensions={0}
  %notme = f32[8]{0} add(f32[8]{0} %all-reduce.1, f32[8]{0} %v)
"""
PARSER_SELF_TEST_EXPECTED = [("all-reduce", 16), ("all-gather", 960), ("reduce-scatter", 8),
                             ("collective-permute", 8), ("all-to-all", 64)]
