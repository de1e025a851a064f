"""The random inputs of bench.py's cases, in torch or in JAX: logits [T, V] ~ N(0,
LOGIT_SCALE^2) in the case's dtype, int targets, the bool keep mask of a masked case
(random byte < MASK_THRESHOLD; uint8 for the Mosaic uint8-mask row, converted here so
that no timed call pays for it) and the two float32 cotangents. Every set is fresh (one
seed counter for both frameworks). The [T, V] arrays are made in row blocks of at most
BLOCK_ELEMENTS (`block_rows`), so no full-size temporary (JAX's random bits, torch's
mask bytes) sits next to them; how many sets a case gets is `n_sets` (runner.py's doc).
torch.compile's inputs are marked dynamic in T, as RL batches vary in length.
"""

from __future__ import annotations

from benchmarks.cases import LOGIT_SCALE, MASK_THRESHOLD, MOSAIC_U8
from benchmarks.harness import roofline_bytes

BLOCK_ELEMENTS = 1 << 27  # the [T, V] inputs are generated in row blocks of at most this


def block_rows(T, V, limit=BLOCK_ELEMENTS):
    """Rows per block of a [T, V] input made block by block: T halved while a block has
    more than `limit` elements (T itself when T is odd: one block)."""
    rows = T
    while rows % 2 == 0 and rows * V > limit:
        rows //= 2
    return rows


class CaseInputs:
    """Makes the input sets of one case at a time; the jitted JAX generators are kept per
    shape until `clear` (bench.py moves to the next size)."""

    def __init__(self, torch, jax, tdev, max_input_gb):
        self.torch = torch
        self.jax = jax
        self.jnp = jax.numpy
        self.tdev = tdev  # torch's device
        self.max_input_gb = max_input_gb  # two sets when both fit in this, else one
        self._generators = {}  # jitted JAX input generators per (shape, dtype, kind)
        self.seed = 0

    def clear(self):
        """Between sizes: the input generators' executables are all JAX caches per size."""
        self._generators.clear()

    def next_seed(self):
        self.seed += 1
        return self.seed

    def n_sets(self, case):
        fwd_bytes, _ = roofline_bytes(case.dtype, case.T, case.V, case.mask)
        return 2 if 2 * fwd_bytes <= self.max_input_gb * 1e9 else 1

    def torch_inputs(self, case, requires_grad):
        torch = self.torch
        gen = torch.Generator(device=self.tdev).manual_seed(1000 + self.next_seed())
        dtype = getattr(torch, case.dtype)
        x = torch.randn((case.T, case.V), generator=gen, device=self.tdev, dtype=dtype)
        x.mul_(LOGIT_SCALE)
        x.requires_grad_(requires_grad)
        y = torch.randint(0, case.V, (case.T,), generator=gen, device=self.tdev,
                          dtype=torch.int64)
        m = None
        if case.mask:  # random bytes < threshold, a row block at a time (no [T, V] uint8)
            m = torch.empty((case.T, case.V), device=self.tdev, dtype=torch.bool)
            rows = block_rows(case.T, case.V)
            for i in range(0, case.T, rows):
                raw = torch.randint(0, 256, (min(rows, case.T - i), case.V), generator=gen,
                                    device=self.tdev, dtype=torch.uint8)
                torch.lt(raw, MASK_THRESHOLD, out=m[i:i + rows])
            del raw
        gl = torch.randn((case.T,), generator=gen, device=self.tdev, dtype=torch.float32)
        gh = torch.randn((case.T,), generator=gen, device=self.tdev, dtype=torch.float32)
        if case.impl == "torch-compile":
            # T varies from batch to batch in RL: compile with T dynamic, V static (one
            # graph per V, dtype and grad mode, reused across T; no recompile per T).
            import torch._dynamo as dynamo
            for t in (x, y, m):
                if t is not None:
                    dynamo.mark_dynamic(t, 0)
            for t in (x, m):
                if t is not None:
                    dynamo.mark_static(t, 1)
        return (x, y, m, gl, gh)

    def jax_inputs(self, case):
        jax, jnp = self.jax, self.jnp
        key = jax.random.key(2000 + self.next_seed())
        kx, ky, km, kg = jax.random.split(key, 4)
        dtype = jnp.dtype(case.dtype)
        shape = (case.T, case.V)
        gen = self._generators
        if (shape, dtype) not in gen:  # one compile per shape, not per call
            gen[(shape, dtype)] = self._blockwise(
                shape, lambda k, s: jax.random.normal(k, s, dtype) * jnp.asarray(LOGIT_SCALE,
                                                                                   dtype))
        if (shape, "mask") not in gen:  # random bytes: no [T, V] float32 temporary
            gen[(shape, "mask")] = self._blockwise(
                shape, lambda k, s: jax.random.bits(k, s, jnp.uint8) < MASK_THRESHOLD)
        x = gen[(shape, dtype)](kx)
        y = jax.random.randint(ky, (case.T,), 0, case.V, jnp.int32)
        m = gen[(shape, "mask")](km) if case.mask else None
        if m is not None and case.impl == MOSAIC_U8:  # made outside the timed calls
            m = m.astype(jnp.uint8)
        gl, gh = jax.random.normal(kg, (2, case.T), jnp.float32)
        return jax.block_until_ready((x, y, m, gl, gh))

    def _blockwise(self, shape, make):
        """jit(key -> [T, V] array), made `block_rows` rows at a time by `make(key, block
        shape)` into the output (lax.map: one block's temporaries, e.g. the random bits,
        at a time; the reshape is free), so the peak is the array itself."""
        jax = self.jax
        T, V = shape
        rows = block_rows(T, V)

        def gen(key):
            keys = jax.random.split(key, T // rows)
            return jax.lax.map(lambda k: make(k, (rows, V)), keys).reshape(T, V)
        return jax.jit(gen)
