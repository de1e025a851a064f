"""The Mosaic GPU kernels as MLIR text, without debug locations: a check that a refactor
changes no kernel. Runs on CPU (lowering for CUDA needs no GPU).

    git stash; python -m benchmarks.tools.kernel_asm --out /tmp/before.mlir; git stash pop
    python -m benchmarks.tools.kernel_asm --out /tmp/after.mlir
    cmp /tmp/before.mlir /tmp/after.mlir    # identical: the kernels did not change

Each kernel's module is taken out of the lowered program's `mosaic_gpu` custom call and
printed without locations (source lines would differ after any move of code). Covered:
the direct route's kernels (`jaxops/backends/mosaic/direct.py`), which are `pallas_mosaic`'s
forward and backward kernels plus their prologue/epilogue, at fp32/bf16, with and without
a mask and entropy, V_loc from 1024 to 151,936. Used once so far: the `_mask_reader`
refactor left all 10 modules identical under jax 0.10.2 and 0.11.2, and changing one
constant in the mask read changed them.
"""

if __name__ == "__main__" and not __package__:  # run by path: see benchmarks/__init__.py
    import os, sys  # noqa: E401
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import argparse

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax.experimental.mosaic import gpu as mgpu

from jaxops.backends.mosaic import direct as md

# (T, V_loc, dtype, masked, with_entropy)
CONFIGS = [(128, 1024, jnp.float32, False, True), (128, 18992, jnp.bfloat16, True, True),
           (64, 4096, jnp.bfloat16, True, False), (256, 151936, jnp.float32, False, False)]


def kernel_modules(fn, structs) -> list[str]:
    """The Mosaic GPU modules in `fn` lowered for CUDA at `structs`, as text."""
    module = jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",)).compiler_ir()
    texts = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if (inner.name == "stablehlo.custom_call"
                            and "mhlo.backend_config" in inner.attributes):
                        data = inner.attributes["mhlo.backend_config"]["module"].value_bytes
                        with module.context as ctx:
                            mgpu.dialect.register_dialect(ctx)
                            # jax 0.10's modules also hold ops of a dialect that the
                            # Python side does not register; printed generically.
                            ctx.allow_unregistered_dialects = True
                            kernel = ir.Module.parse(data)
                            texts.append(kernel.operation.get_asm(enable_debug_info=False))
                    walk(inner)

    walk(module.operation)
    return texts


def kernels(configs=CONFIGS):
    """(name, fn, operand structs) of every direct-route kernel at `configs`."""
    S = jax.ShapeDtypeStruct
    for T, V, dtype, masked, with_entropy in configs:
        common = dict(masked=masked, with_entropy=with_entropy, inv_tau=1 / 0.7)
        inputs = ([S((T, V), dtype)] + ([S((T, V), jnp.uint8)] if masked else [])
                  + [S((T,), jnp.int32)])
        name = f"T{T}-V{V}-{jnp.dtype(dtype).name}-mask{int(masked)}-ent{int(with_entropy)}"
        yield f"partials {name}", md.partials_kernel(T, V, dtype, **common), inputs
        if md.one_pass(V, dtype, masked):
            yield f"forward {name}", md.forward_kernel(T, V, dtype, **common), inputs
        padded = -(-T // 64) * 64
        saved = [S((padded,), jnp.float32)] * len(md.saved_names(with_entropy, masked))
        cotangents = [S((T,), jnp.float32)] * (1 + with_entropy)
        backward = md.backward_kernel(T, V, dtype, entropy_grad=True, has_d_log_prob=True,
                                      has_d_entropy=with_entropy, **common)
        yield f"backward {name}", backward, inputs + saved + cotangents + [S((T, V), dtype)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    count = 0
    with open(args.out, "w") as f:
        for name, fn, structs in kernels():
            for text in kernel_modules(fn, structs):
                f.write(f"// ---- {name}\n{text}\n")
                count += 1
    print(f"{count} kernel modules written to {args.out} (jax {jax.__version__})")


if __name__ == "__main__":
    main()
