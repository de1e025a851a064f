"""The implementations bench.py compares, each as a forward function
(x, y, m) -> (log_prob, entropy or None) of logits x [T, V], targets y [T] and an optional
bool keep mask m [T, V] (cases.IMPLS lists them; bench.py's doc says what each is)."""

from __future__ import annotations

import os
import tempfile
import traceback

from benchmarks.harness import short_error


class Implementations:
    """Builds the forward function of a case; imports Megatron and the bridge on first use."""

    def __init__(self, torch, jax, *, tau, on_gpu, pallas_config=None, mosaic_config=None,
                 bridge_kwargs=None):
        self.torch = torch
        self.jax = jax
        self.tau = tau
        self.on_gpu = on_gpu
        self.pallas_config = pallas_config  # PallasConfig: Triton (and "pallas")
        self.mosaic_config = mosaic_config  # MosaicConfig: Mosaic GPU
        self.bridge_kwargs = dict(bridge_kwargs or {})
        self._megatron = None  # (fn, group) once initialised
        self._megatron_error = None
        self._bridge = None
        self._bridge_error = None
        self._compiled = {}  # torch.compile'd functions per (entropy, mask)

    # --------------------------------------------------------------- PyTorch
    def torch_reference(self, x, y, m, with_entropy):
        """log_softmax(x.float() / tau) + gather + entropy; masked log-prob via masked_fill."""
        torch = self.torch
        z = x.float() / self.tau
        h = None
        if with_entropy or m is None:
            logp = torch.log_softmax(z, dim=-1)
        if with_entropy:
            h = -(logp.exp() * logp).sum(-1)
        if m is None:
            lp = logp.gather(-1, y[:, None]).squeeze(-1)
        else:
            cols = torch.arange(z.shape[-1], device=z.device)
            keep = m | (cols[None, :] == y[:, None])
            zm = z.masked_fill(~keep, float("-inf"))
            lp = zm.gather(-1, y[:, None]).squeeze(-1) - torch.logsumexp(zm, dim=-1)
        return lp, h

    def torch_compiled(self, entropy, mask):
        key = (entropy, mask)
        if key not in self._compiled:
            ref = self.torch_reference

            def fn(x, y, m):
                return ref(x, y, m, entropy)

            self._compiled[key] = self.torch.compile(fn, fullgraph=True)
        return self._compiled[key]

    def megatron(self):
        """(fused_vocab_parallel_cross_entropy, TP group of size 1); raises RuntimeError
        saying why where megatron-core is not usable (not installed, no NCCL, ...)."""
        if self._megatron is None and self._megatron_error is None:
            try:
                torch = self.torch
                import torch.distributed as dist
                import warnings
                with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
                    warnings.simplefilter("ignore")
                    if not self.on_gpu:
                        # CPU (CI): Megatron's jit fuser is torch.compile (inductor, C++
                        # builds): far too slow for a smoke run; use its no-op fuser there.
                        import megatron.core.jit as mjit
                        mjit.disable_jit_fuser()
                    from megatron.core.fusions.fused_cross_entropy import (
                        fused_vocab_parallel_cross_entropy)
                if not dist.is_initialized():
                    if self.on_gpu:
                        torch.cuda.set_device(0)
                    fd, path = tempfile.mkstemp(prefix="bench-pg-")
                    os.close(fd)
                    os.unlink(path)
                    dist.init_process_group("nccl" if self.on_gpu else "gloo",
                                            init_method=f"file://{path}", rank=0, world_size=1)
                self._megatron = (fused_vocab_parallel_cross_entropy, dist.group.WORLD)
            except Exception as exc:  # not installed, no NCCL, ...
                self._megatron_error = short_error(exc)
        if self._megatron_error:
            raise RuntimeError(f"megatron-core not usable: {self._megatron_error}")
        return self._megatron

    def close(self):
        """Destroy the process group Megatron ran in, if it ran: the error text, or None."""
        if self._megatron is None:
            return None
        try:
            import torch.distributed as dist
            dist.destroy_process_group()
        except Exception as exc:
            return short_error(exc)
        return None

    def bridge(self):
        """bridge.logprob_entropy. The bridge is part of this repository and PyTorch is
        installed (bench.py imports it), so a failing import is a broken bridge: it raises
        (the case's row records the error), it is never a skip."""
        if self._bridge is None and self._bridge_error is None:
            try:
                import bridge as bridge_mod
                self._bridge = bridge_mod.logprob_entropy
            except Exception as exc:
                traceback.print_exc()
                self._bridge_error = short_error(exc)
        if self._bridge_error:
            raise RuntimeError(f"bridge not importable: {self._bridge_error}")
        return self._bridge

    def torch_forward_fn(self, case):
        """(x, y, m) -> (log_prob, entropy or None), for the torch-side implementations."""
        if case.impl == "torch-eager":
            return lambda x, y, m: self.torch_reference(x, y, m, case.entropy)
        if case.impl == "torch-compile":
            return self.torch_compiled(case.entropy, case.mask)
        if case.impl == "megatron":
            fused, group = self.megatron()
            T, V = case.T, case.V

            def fn(x, y, m):
                # Megatron mutates an fp32 input in place: callers pass a clone (timed here).
                loss = fused(x.clone().view(T, 1, V), y.view(T, 1), group)
                return -loss.view(T), None
            return fn
        if case.impl == "bridge":
            fn = self.bridge()
            extra = {"temperature": self.tau, **self.bridge_kwargs}

            def bridged(x, y, m):
                return fn(x, y, keep_mask=m, with_entropy=case.entropy,
                          entropy_grad=case.entropy, **extra)
            return bridged
        raise ValueError(case.impl)

    # --------------------------------------------------------------- JAX
    def jax_forward_fn(self, case):
        """(x, y, m) -> (log_prob, entropy or None), pure JAX (jitted by the caller)."""
        jax = self.jax
        jnp = jax.numpy
        tau = self.tau
        if case.impl.startswith("jaxops-"):
            import jaxops
            # pallas, pallas_triton, pallas_mosaic (-u8: the runner's mask is uint8), xla
            impl = case.impl.split("-")[1]
            # Each backend its own config class (jaxops' resolve() would keep only the
            # interpret flag of the other one's); None: the backend's defaults.
            config = {"pallas": self.pallas_config, "pallas_triton": self.pallas_config,
                      "pallas_mosaic": self.mosaic_config}.get(impl)

            def fn(x, y, m):
                return jaxops.logprob_entropy(
                    x, y, keep_mask=m, temperature=tau, with_entropy=case.entropy,
                    entropy_grad=case.entropy, implementation=impl, pallas_config=config)
            return fn
        if case.impl == "jax-jit":
            def naive(x, y, m):
                z = x.astype(jnp.float32) / tau
                h = None
                if case.entropy or m is None:
                    logp = jax.nn.log_softmax(z, axis=-1)
                if case.entropy:
                    h = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
                if m is None:
                    lp = jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0]
                else:
                    cols = jnp.arange(z.shape[-1], dtype=y.dtype)
                    keep = m | (cols[None, :] == y[:, None])
                    zm = jnp.where(keep, z, -jnp.inf)
                    lp = (jnp.take_along_axis(zm, y[:, None], axis=-1)[:, 0]
                          - jax.nn.logsumexp(zm, axis=-1))
                return lp, h
            return naive
        raise ValueError(case.impl)
