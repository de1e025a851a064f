"""Pallas kernels lowered through Triton (any CUDA GPU; interpret mode off-GPU).

  config.py     `PallasConfig` and its tuned defaults
  common.py     what the kernels share: tile loading, the online-softmax update, specs
  forward.py    the statistics kernel and `forward_stats` (the design notes are there)
  backward.py   the gradient kernel and `backward_logits`
  kernels.py    the entry points the registry hands out
  offsets.py    64-bit indexing of 2**31+-element operands where the lowering needs it
"""
