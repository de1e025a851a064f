"""Launch parameters of the Mosaic GPU kernels, their defaults, and the shapes they take.

Apart from the kernels so that the public API can name `MosaicConfig` without
importing Mosaic GPU.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Launch parameters of the Mosaic GPU kernels (`backends/mosaic/`); `None` fields
    take the defaults of `mosaic_defaults`, chosen from H200 sweeps
    (`benchmarks/tools/mosaic_tune.py`; docs/performance.md, "Mosaic kernels")."""

    # Vocabulary columns per tile; a CTA holds [64, block_v] tiles (multiple of 64).
    block_v: int | None = None
    # Tiles in flight per CTA (TMA pipeline depth).
    num_stages: int | None = None
    # Vocabulary columns per CTA: the grid is (row blocks, ceil(V_loc / chunk_v)) so
    # that small T still fills the GPU. A function of V_loc only, never of T (a row's
    # result must not depend on the batch); chunks are balanced to whole tiles.
    chunk_v: int | None = None
    # ex2.approx for exp2 (as PallasConfig.approx_exp2).
    approx_math: bool = True
    interpret: bool = False


# Vocabulary columns per CTA. Narrower chunks mean more, shorter CTAs: fewer idle SMs in
# the last wave where the grid is only a few waves deep (small T or small V_loc). On the
# H200 (benchmarks/results/h200_mosaic_tune_small.json, bf16 with entropy, kernels alone,
# forward+backward x roofline) 2048 against 4096: T = 1024 1.27x vs 1.34x, T = 8192 at
# V_loc = 18,992 1.51x vs 1.60x, at V = 151,936 1.052x vs 1.057x. With a keep mask the
# wider chunk wins at T = 8192, V = 151,936 (benchmarks/results/h200_mosaic_chunk_masked.json,
# public op, uint8 mask, forward+backward x roofline, 2048 / 4096 / 8192): bf16 with entropy
# 1.083 / 1.064 / 1.068, bf16 log-prob only 1.044 / 1.036 / 1.054, fp32 1.023 / 1.017 / 1.030.
_CHUNK_V = 2048
_CHUNK_V_MASKED = 4096


def mosaic_defaults(config: MosaicConfig, *, itemsize: int, masked: bool,
                    backward: bool) -> MosaicConfig:
    """`config` with its `None` fields filled in for one kernel launch.

    Shared memory per CTA is num_stages * (tile + mask tile [+ gradient tile]); the
    defaults keep it near 100-130 KiB, so one or two CTAs fit an SM's 227 KiB. The
    masked forward gets at most 96 KiB, so that two CTAs share an SM: on the H200 at
    T = 8192, V = 151,936 (benchmarks/results/h200_mosaic_tune.json) bf16 with 5 stages
    (120 KiB, one CTA per SM) took 1.26 ms, with 2-4 stages 0.94-0.97 ms."""
    block_v = config.block_v or 128
    if block_v % 64 or block_v <= 0:
        raise ValueError(f"block_v must be a positive multiple of 64, got {block_v}")
    tile = 64 * block_v * itemsize
    per_stage = tile * (2 if backward else 1) + (64 * block_v if masked else 0)
    budget = (96 if masked and not backward else 128) * 1024
    num_stages = config.num_stages or max(2, min(6, budget // per_stage))
    return dataclasses.replace(
        config, block_v=block_v, num_stages=num_stages,
        chunk_v=config.chunk_v or (_CHUNK_V_MASKED if masked else _CHUNK_V))


def mosaic_rows_tile(num_tokens: int) -> bool:
    """Whether the Mosaic kernels' [T, V_loc] operands can move tiled, swizzled tiles:
    Mosaic GPU tiles each operand's whole TMA descriptor by 8 rows, so T must be below
    8 or a multiple of 8. Other T still work, with untiled tiles read with bank
    conflicts (`mosaic.common.tile_transforms`; slower, the same bits)."""
    return num_tokens <= 8 or num_tokens % 8 == 0


def mosaic_supported(num_vocab: int, itemsize: int, masked: bool) -> bool:
    """Shapes the Mosaic GPU kernels take; the others fall back to the XLA implementation.

    TMA needs 16-byte-aligned row strides (the mask: V_loc % 16 == 0); the logits
    tile is also swizzled (at least 32 bytes wide), which TMA tiles only if the
    swizzle width divides V_loc (fp32: V_loc % 8, bf16: V_loc % 16)."""
    return num_vocab % (32 // itemsize) == 0 and (not masked or num_vocab % 16 == 0)


def supported_vocab(itemsize: int, masked: bool) -> str:
    """`mosaic_supported`'s rule in words, for the messages of calls it refuses."""
    return (f"a multiple of {32 // itemsize} for {itemsize}-byte logits"
            + (" and of 16 with a keep mask" if masked else "") + " (TMA tiles)")


def check_supported(num_vocab: int, itemsize: int, masked: bool, config: MosaicConfig):
    """A clear ValueError where the compiled kernels cannot take V_loc (the registry
    sends those calls to the XLA backend; `interpret` mode takes any V_loc)."""
    if not config.interpret and not mosaic_supported(num_vocab, itemsize, masked):
        raise ValueError(
            f"the Mosaic GPU kernels take V_loc {supported_vocab(itemsize, masked)}, got "
            f"V_loc = {num_vocab}; call them through `registry.kernels('pallas_mosaic')`, "
            "which computes such calls with XLA")
