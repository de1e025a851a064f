"""One fresh process for tests/bridge/test_bridge_cache.py: the bridge's calls on a few small
configurations, reported as one JSON line.

    python tests/bridge/_cache_worker.py CASE [CASE ...]    (CASE: a key of CASES)

Per case: a digest of log_prob, entropy and d logits (bit-exact comparison across
processes), the largest error against a float64 torch reference, and JAX's
persistent-cache hits and misses during the case. Also: the warnings raised, the cache
folder in use and JAX's cache settings. The environment (JAXOPS_CACHE_DIR,
JAX_COMPILATION_CACHE_DIR, XDG_CACHE_HOME) is the test's.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings

CASES = {  # name: (T, V_loc, dtype) -- T = 5 and 3 use windows (4, 1) and (2, 1)
    "f32": (5, 64, "float32"),
    "bf16": (3, 64, "bfloat16"),
    "f32_wide": (5, 128, "float32"),
}


def run_case(name, events):
    import torch

    import bridge

    T, V, dtype = CASES[name]
    gen = torch.Generator().manual_seed(0)
    logits64 = torch.randn(T, V, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, V, (T,), generator=gen)
    x = logits64.to(getattr(torch, dtype)).requires_grad_()
    before = dict(events)
    lp, ent = bridge.logprob_entropy(x, targets)
    (lp.sum() + 0.5 * ent.sum()).backward()
    ref = torch.log_softmax(x.detach().double(), -1)
    ref_lp = ref.gather(1, targets[:, None])[:, 0]
    ref_ent = -(ref.exp() * ref).sum(-1)
    err = max((lp.double() - ref_lp).abs().max().item(),
              (ent.double() - ref_ent).abs().max().item())
    digest = hashlib.sha256()
    for t in (lp, ent, x.grad.float()):
        digest.update(t.detach().contiguous().numpy().tobytes())
    return {"digest": digest.hexdigest(), "max_err": err, "grad_finite":
            bool(torch.isfinite(x.grad.float()).all()),
            **{k: events.get(k, 0) - before.get(k, 0) for k in ("cache_hits", "cache_misses")}}


def main(names):
    import jax

    events: dict = {}

    def on_event(event, **_):
        key = event.rsplit("/", 1)[-1]
        events[key] = events.get(key, 0) + 1

    jax.monitoring.register_event_listener(on_event)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import bridge

        results = {name: run_case(name, events) for name in names}
    out = {"cases": results, "warnings": [str(w.message) for w in caught],
           "cache_dir": bridge.compilation_cache_dir(),
           "jax_cache_dir": jax.config.jax_compilation_cache_dir,
           "jax_max_size": jax.config.jax_compilation_cache_max_size}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
