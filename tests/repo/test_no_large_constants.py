"""No jitted program carries a large array as a constant.

An array that a jitted function closes over (instead of taking it as an argument) is
baked into the compiled program as a literal. At T = 8192, V = 151,936 the demo's
closures captured the 1.2 GB keep mask this way: each masked program was 2.49 GB of HLO
text and took ~46 s to compile on an H200, and `python -m jaxops.demo` did not finish in
7 minutes.

Two checks, both on CPU:

- JAX reports the bytes of constants captured by every program it lowers (the
  `jax_captured_constants_warn_bytes` option): set to a few KB, any captured array of
  that size shows up as a warning. The demo runs end to end at a small size under it, and
  the examples' and the bridge's jitted entry points are lowered under it.
- The demo's programs, lowered at the demo's GPU size, are a few hundred KB of HLO text
  at most (a captured [T, V] mask alone would be gigabytes).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CONSTANT_LIMIT = 4096  # bytes of captured constants allowed per program
HLO_TEXT_LIMIT = 1 << 20  # bytes of HLO text per program at the GPU size
GPU_T, GPU_V = 8192, 151_936
S = jax.ShapeDtypeStruct


@contextlib.contextmanager
def captured_constant_reports():
    """Yields a list that collects JAX's reports of programs lowered in the block with
    more than CONSTANT_LIMIT bytes of captured constants."""
    reports = []
    previous = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", CONSTANT_LIMIT)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield reports
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", previous)
    # jax 0.10/0.11: "A large amount of constants were captured during lowering ...";
    # jax 0.12 (simplified jaxpr constants): "Closed-over constant ...", one per array.
    reports.extend(str(w.message).split(" If this is intentional")[0] for w in caught
                   if "constant" in str(w.message).lower()
                   and ("captured" in str(w.message).lower()
                        or "closed-over" in str(w.message).lower()))


def _load(relative, name):
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_demo_captures_no_arrays(monkeypatch, capsys):
    """The whole demo, at a size where its keep mask is 16 KB: no program captures it."""
    from jaxops import demo

    monkeypatch.setattr(demo, "TIMING_REPEATS", 1, raising=False)  # only the lowering matters
    jax.clear_caches()  # every program is lowered again, under the check
    with captured_constant_reports() as reports:
        demo.main(["--tokens", "16", "--vocab", "1024"])
    out = capsys.readouterr().out
    assert not reports, f"{len(reports)} demo programs captured arrays: {reports[:3]}"
    # ... and the demo's output is still its table of 8 rows.
    rows = [line for line in out.splitlines() if line.strip().startswith(("float32", "bfloat16"))]
    assert len(rows) == 8, out


@pytest.mark.parametrize("implementation,dtype", [
    ("pallas", jnp.bfloat16), ("pallas", jnp.float32), ("xla", jnp.bfloat16),
    ("reference", jnp.float64)], ids=lambda v: v if isinstance(v, str) else jnp.dtype(v).name)
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
def test_demo_programs_are_small_at_gpu_size(implementation, dtype, masked):
    """demo.forward / demo.forward_backward lowered at T = 8192, V = 151,936 (abstract
    shapes: nothing is allocated). On CPU the Pallas kernels lower in interpret mode."""
    from jaxops import demo

    logits, rows = S((GPU_T, GPU_V), dtype), S((GPU_T,), jnp.float32)
    targets = S((GPU_T,), jnp.int32)
    mask = S((GPU_T, GPU_V), jnp.bool_) if masked else None
    options = dict(implementation=implementation, temperature=0.8)
    with captured_constant_reports() as reports:
        sizes = {
            "forward": len(demo.forward.trace(logits, targets, mask, **options)
                           .lower().as_text()),
            "forward_backward": len(demo.forward_backward.trace(
                logits, targets, mask, rows, rows, **options).lower().as_text()),
        }
    assert not reports, reports
    assert max(sizes.values()) < HLO_TEXT_LIMIT, sizes


def test_jax_grpo_example_programs_capture_no_arrays():
    """examples/jax_grpo.py's module-level jitted functions, lowered at its own sizes
    (and, as the example runs, without float64)."""
    grpo = _load("examples/jax_grpo.py", "_jax_grpo_example")
    with jax.enable_x64(False):
        _lower_jax_grpo_programs(grpo)


def _lower_jax_grpo_programs(grpo):
    key = jax.random.key(0)
    params = grpo.init_params(key)
    opt_state = grpo.adam_init(params)
    prompts = jnp.zeros((grpo.PROMPTS * grpo.GROUP,), jnp.int32)
    responses, old_log_probs, masks = jax.eval_shape(grpo.rollout, params, prompts, key)
    advantages = S(prompts.shape, jnp.float32)
    with captured_constant_reports() as reports:
        grpo.rollout.trace(params, prompts, key).lower()
        for mask in (masks, None):
            batch = (prompts, responses, old_log_probs, mask, advantages)
            grpo.train_step.trace(params, opt_state, batch).lower()
            grpo.batch_loss.trace(params, batch).lower()
        grpo.unmasked_log_probs.trace(params, prompts, responses).lower()
    assert not reports, reports


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_bridge_programs_capture_no_arrays(implementation):
    """The bridge's jitted functions (one per static configuration) and the staged API
    under them, lowered at the GPU size for a single shard and for one of 8 shards."""
    from bridge import _jaxfns

    from jaxops import PallasConfig

    config = PallasConfig(interpret=True) if implementation == "pallas" else None
    with captured_constant_reports() as reports:
        for world in (1, 8):
            num_vocab = GPU_V // world
            logits = S((GPU_T, num_vocab), jnp.bfloat16)
            mask = S((GPU_T, num_vocab), jnp.bool_)
            raw_targets = S((2 * GPU_T,), jnp.int32)  # int64 ids as int32 pairs
            static = dict(inv_tau=1.25, with_entropy=True, masked=True,
                          implementation=implementation, config=config, target_mode="i64")
            forward = _jaxfns.local_forward(shard_index=world - 1, world=world, **static)
            forward.trace(logits, raw_targets, mask).lower()
            gathered = S((world, 6, GPU_T), jnp.float32)
            if world > 1:
                _jaxfns.combine(num_vocab=num_vocab, with_entropy=True, masked=True,
                                target_mode="i64").trace(gathered, raw_targets).lower()
            static.pop("with_entropy")
            _jaxfns.local_backward(
                shard_index=world - 1, with_entropy=True, entropy_grad=True,
                has_d_log_prob=True, has_d_entropy=True, write_through=False, **static,
            ).trace(logits, raw_targets, mask, gathered, S((GPU_T, 2), jnp.float32)).lower()
    assert not reports, reports


@pytest.mark.slow
def test_multihost_example_captures_no_arrays():
    """examples/multihost.py (one process, 2 CPU devices) with JAX's report threshold set
    through its environment variable: no program of the example captures an array."""
    env = dict(os.environ)
    env["JAX_CAPTURED_CONSTANTS_WARN_BYTES"] = str(CONSTANT_LIMIT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "multihost.py"), "--cpu-devices", "2",
         "--tokens", "16", "--vocab", "1024"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "OK" in done.stdout, output[-3000:]
    for report in ("constants were captured", "Closed-over constant"):  # jax <0.12, 0.12
        assert report not in output, output[-3000:]


def test_the_check_sees_a_captured_array():
    """The check itself: a closure over a 16 KB array is reported, an argument is not."""
    mask = jnp.asarray(np.arange(16 * 1024) % 3 == 0).reshape(16, 1024)

    with captured_constant_reports() as reports:
        jax.jit(lambda x: jnp.where(mask, x, 0.0)).lower(S((16, 1024), jnp.float32))
    assert len(reports) == 1, reports
    with captured_constant_reports() as reports:
        jax.jit(lambda x, m: jnp.where(m, x, 0.0)).lower(S((16, 1024), jnp.float32), mask)
    assert not reports, reports
