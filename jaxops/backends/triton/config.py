"""Launch parameters and kernel variants of the Pallas implementation, and their tuned defaults.

Kept apart from `backends/triton/kernels.py` so that the public API can name `PallasConfig`
without importing Pallas or its Triton lowering (that happens on first use of the
"pallas" implementation, see `backends/registry.py`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PallasConfig:
    """Launch parameters and kernel variants; `None` fields take the tuned defaults."""

    block_v: int | None = None  # vocabulary tile, a power of two (2048; 1024 with a mask)
    num_warps: int | None = None
    num_stages: int | None = None
    # ex2.approx (one MUFU instruction) instead of libdevice's exp2f; the
    # kernels are ALU-bound on bf16 without it.
    approx_exp2: bool = True
    # Skip the per-tile rescale of the running sums (a scalar branch) when the
    # tile does not raise the row max (the skipped factor is exactly 1). None:
    # only for the log-prob-only, unmasked forward, the one case where it was
    # faster on the H200 (docs/performance.md, "Triton kernels: tuned defaults").
    skip_rescale: bool | None = None
    # Issue the next tile's loads before folding the current one (the tile is
    # carried through the loop in registers), so each program keeps two tiles of
    # HBM reads in flight instead of one. None: the tuned default (2-byte logits,
    # except the forward with entropy).
    prefetch: bool | None = None
    # Reduce each tile's sums to scalars before accumulating (one cross-thread
    # reduction per sum and tile) instead of carrying per-lane accumulators:
    # fewer registers per thread, so more programs per SM. None: the tuned
    # default (the forward with entropy, 2-byte logits).
    scalar_sums: bool | None = None
    interpret: bool = False
    # Print the Triton IR of each kernel when it is lowered (tests read it).
    debug: bool = False


def _next_power_of_2(x: int) -> int:
    """The smallest power of two >= x (as `jax.experimental.pallas.next_power_of_2`)."""
    return 1 if x == 0 else 2 ** (x - 1).bit_length()


def with_tuned_defaults(config: PallasConfig, num_vocab: int, *, masked: bool, itemsize: int,
                        with_entropy: bool = True, backward: bool = False) -> PallasConfig:
    """`config` with its `None` fields filled in for one kernel launch.

    The tuned defaults (docs/performance.md, "Triton kernels: tuned defaults"): one tile
    size fits fp32 and bf16; masked kernels carry a third per-lane vector and the mask
    bytes and run faster on half the tile. With 2-byte logits a tile is too few bytes in
    flight per program: the forward with entropy reduces its sums per tile (fewer
    registers, more programs per SM), the other kernels prefetch the next tile. fp32 keeps
    the plain kernels (at the roofline already)."""
    narrow = itemsize < 4
    block_v = config.block_v or (1024 if masked else 2048)
    block_v = min(block_v, _next_power_of_2(max(num_vocab, 16)))
    if block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    return dataclasses.replace(
        config,
        block_v=block_v,
        num_warps=config.num_warps or 4,
        num_stages=config.num_stages or 2,
        skip_rescale=(not (with_entropy or masked) if config.skip_rescale is None
                      else config.skip_rescale),
        prefetch=(narrow and (backward or not with_entropy) if config.prefetch is None
                  else config.prefetch),
        scalar_sums=(narrow and with_entropy and not backward if config.scalar_sums is None
                     else config.scalar_sums),
    )
