"""The backends that compute the op's per-shard statistics, and the one policy that picks one.

  registry.py   names -> backends, capability probing, the choice for every entry point
  xla.py        the statistics in fused `jnp` (the CPU path; any shape)
  triton/       Pallas kernels lowered through Triton (any CUDA GPU; interpret mode off-GPU)
  mosaic/       Pallas kernels lowered through Mosaic GPU (Hopper and newer)

Every backend's kernels module provides `forward_stats` and `backward_logits` with the
signatures `contract.py` defines. Importing this package (or a `config` module) loads
no Pallas lowering; the kernels modules are imported on first use (`registry.kernels`).
"""
