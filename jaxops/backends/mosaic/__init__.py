"""Pallas kernels lowered through Mosaic GPU (Hopper, sm_90+).

  config.py     `MosaicConfig`, its defaults, the shapes the kernels take
  common.py     what the kernels share: version shims, tile and target movement, chunking
  forward.py    the statistics kernel and `forward_stats` (the design notes are there)
  backward.py   the gradient kernel and `backward_logits`
  kernels.py    the entry points the registry hands out
  mask_view.py  bool keep masks read in place as bytes
  direct.py     whole-row kernels for the bridge's direct route (no XLA in between)
  direct_rows.py  those kernels composed in JAX (tests; the launcher's shapes)
  linear.py     the fused LM head's GEMM + statistics kernels
"""
