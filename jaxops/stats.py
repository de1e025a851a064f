"""Per-shard softmax statistics: the one place where the `[T, V_loc]` logits are touched.

`local_stats` reduces each row of this shard's logits to a handful of numbers
(docs/design.md §3; the fields and what they mean are `contract.LocalStats`). Everything
downstream -- the cross-shard combine, log-prob, entropy -- is plain
differentiable JAX on `[T]` arrays (see `combine.py`).

Its custom VJP differentiates the sums with the row maxima (and the masked sum's
reference point) held constant. That is exact for anything computed from the
statistics that does not depend on which reference point was used (log-sum-exp,
entropy, log-prob), and it lets the backward recompute every probability from the
logits and the saved maxima: O(T) residuals, no saved softmax, one write of the
gradient. The work is done by the implementation's `forward_stats` and
`backward_logits` (`contract.py`), looked up by name in `registry.py`.

A gradient of the gradient differentiates the backward itself: for the Pallas kernels,
which JAX cannot differentiate, `backward_logits` here lends them XLA's derivative
(`with_xla_derivative`), so every implementation gives the same second order.
"""

from __future__ import annotations

import functools

import jax

from jaxops.backends import registry
from jaxops.backends.triton.config import PallasConfig
from jaxops.contract import LocalStats, backward_coefs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def local_stats(
    logits: jax.Array,  # [T, V_loc] float32 | bfloat16 | float16
    local_targets: jax.Array,  # [T] int32, index into this shard (may be out of range)
    keep_mask: jax.Array | None,  # [T, V_loc] bool (pallas_mosaic: or uint8) or None
    inv_tau: float,
    with_entropy: bool,
    entropy_grad: bool,
    implementation: str,  # "pallas" | "xla"
    config: PallasConfig | None,  # launch parameters for "pallas"; None for "xla"
) -> LocalStats:
    """This shard's row statistics; see the module docstring."""
    del entropy_grad
    return registry.kernels(implementation).forward_stats(
        logits, local_targets, keep_mask, inv_tau=inv_tau,
        with_entropy=with_entropy, config=config)


def _local_stats_fwd(logits, local_targets, keep_mask, inv_tau, with_entropy,
                     entropy_grad, implementation, config):
    stats = local_stats(logits, local_targets, keep_mask, inv_tau, with_entropy,
                        entropy_grad, implementation, config)
    residuals = (logits, local_targets, keep_mask, stats.max_logit, stats.masked_max)
    return stats, residuals


def _local_stats_bwd(inv_tau, with_entropy, entropy_grad, implementation, config,
                     residuals, cotangents: LocalStats):
    logits, local_targets, keep_mask, max_logit, masked_max = residuals
    coefs = backward_coefs(cotangents, with_entropy and entropy_grad, keep_mask is not None)
    dlogits = backward_logits(implementation, logits, local_targets, keep_mask, max_logit,
                              masked_max, coefs, inv_tau=inv_tau, config=config)
    return dlogits, None, None


local_stats.defvjp(_local_stats_fwd, _local_stats_bwd)


def backward_logits(implementation: str, logits, local_targets, keep_mask, max_logit,
                    masked_max, coefs, *, inv_tau, config, out_dtype=None):
    """`implementation`'s `backward_logits`, differentiable: a Pallas kernel gets the
    derivative of `xla.backward_logits` (`with_xla_derivative`), so that a gradient of
    the op's gradient (a Hessian-vector product, a gradient penalty) works with every
    implementation, not only the jnp ones."""
    kernel = registry.kernels(implementation).backward_logits
    if not registry.is_pallas(implementation):
        return kernel(logits, local_targets, keep_mask, max_logit, masked_max, coefs,
                      inv_tau=inv_tau, config=config, out_dtype=out_dtype)
    from jaxops.backends import xla

    def run(with_kernel, *args):
        fn = kernel if with_kernel else xla.backward_logits
        return fn(*args, inv_tau=inv_tau, config=config if with_kernel else None,
                  out_dtype=out_dtype)

    return with_xla_derivative(functools.partial(run, True), functools.partial(run, False))(
        logits, local_targets, keep_mask, max_logit, masked_max, coefs)


def with_xla_derivative(kernel, jnp_fn):
    """`kernel` (a Pallas call, which JAX cannot differentiate) with the derivative of
    `jnp_fn`, a jnp function of the same arguments computing the same values to
    rounding. Only a gradient *of the backward* differentiates these: the op's own
    custom VJPs never do, so first-order gradients run the kernels alone."""
    @jax.custom_jvp
    def call(*args):
        return kernel(*args)

    @call.defjvp
    def call_jvp(primals, tangents):
        _, tangent_out = jax.jvp(jnp_fn, primals, tangents)
        return call(*primals), tangent_out

    return call
