"""What bench.py measures: the implementations, the sizes per mode, the cases in run order,
and `--filter`. Standard library only (`--dry-run` needs no GPU and no JAX)."""

from __future__ import annotations

import dataclasses
import fnmatch

from benchmarks.harness import BOOL

# The op's Pallas kernels. "jaxops-pallas" is implementation="pallas", the default callers
# get (`jaxops.backends.registry.pallas_backend`): on Hopper the Mosaic GPU kernels for every
# V_loc whose rows TMA can tile, bool masks read in place (jaxops.backends.mosaic.mask_view.ENABLED), never
# a function of T; Triton before Hopper and for V_loc TMA cannot tile. The default set times
# it next to "jaxops-pallas_triton" (the pre-Hopper path, for comparison). On Hopper
# "jaxops-pallas_mosaic" and MOSAIC_U8 (the Mosaic backend handed the keep mask as uint8:
# masked cases only) time the default's own kernels again, so they run only when a --filter
# names them (EXTRA_IMPLS: a glob like `jaxops-*` selects them too).
MOSAIC_U8 = "jaxops-pallas_mosaic-u8"
DEFAULT_PALLAS = "jaxops-pallas"
PALLAS_IMPLS = (DEFAULT_PALLAS, "jaxops-pallas_triton", "jaxops-pallas_mosaic", MOSAIC_U8)
EXTRA_IMPLS = ("jaxops-pallas_mosaic", MOSAIC_U8)  # --filter only
IMPLS = PALLAS_IMPLS + ("jaxops-xla", "bridge", "jax-jit", "torch-compile", "torch-eager",
                        "megatron")  # every name --filter impl= knows, in run order
DEFAULT_IMPLS = tuple(i for i in IMPLS if i not in EXTRA_IMPLS)  # no impl filter
JAX_IMPLS = PALLAS_IMPLS + ("jaxops-xla", "jax-jit")  # the others run from PyTorch
TORCH_IMPLS = ("megatron", "torch-eager", "torch-compile")
# Big sizes: these run first (build_cases). The bridge counts: its buffers (the [T, V_loc]
# gradient included) come from torch's allocator, which JAX's grown pool would starve.
TORCH_POOL_IMPLS = TORCH_IMPLS + ("bridge",)
DTYPES = ("float32", "bfloat16")
V_FULL, V_SHARD = 151_936, 151_936 // 8
MAIN_T, MAIN_V = 8192, V_FULL
MASK_THRESHOLD = 13  # keep mask = random byte < 13: ~5% kept (the target always counts)
MASK_DENSITY = MASK_THRESHOLD / 256
LOGIT_SCALE = 3.0  # logits ~ N(0, 3^2)


@dataclasses.dataclass(frozen=True)
class Case:
    impl: str
    dtype: str
    T: int
    V: int
    entropy: bool
    mask: bool

    @property
    def key(self):
        return (self.impl, self.dtype, self.T, self.V, self.entropy, self.mask)


def all_combos():
    return [(d, e, m) for d in DTYPES for e in (False, True) for m in (False, True)]


def size_groups(mode):
    """[(T, V, combos)] in priority order: the most important first."""
    if mode == "tiny":
        # Every implementation and code path once (both dtypes, entropy, mask), two sizes
        # for the plot, one vocabulary shard; Pallas runs in interpret mode (slow compiles).
        both = [("float32", False, False), ("bfloat16", True, True)]
        return [(32, 1000, both), (64, 1000, both), (32, 1000 // 8, [("float32", True, False)])]
    if mode == "quick":
        # One device call (< 9 min incl. compiles): everything at the headline size, then
        # two combos per other size (Megatron's and the entropy path), largest first.
        two = [("float32", False, False), ("bfloat16", True, False)]
        return [(MAIN_T, MAIN_V, all_combos()),
                (32768, V_FULL, two),
                (1024, V_FULL, two),
                (MAIN_T, V_SHARD, two)]
    return [(MAIN_T, MAIN_V, all_combos()),
            (MAIN_T, V_SHARD, all_combos()),
            (1024, V_FULL, all_combos()),
            (32768, V_FULL, all_combos())]


# ---------------------------------------------------------------------------- filters

_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float32": "float32",
                  "bf16": "bfloat16", "bfloat16": "bfloat16"}


def parse_filters(specs):
    """['impl=jaxops-*,megatron', 'dtype=bf16', 'T=8192'] -> {key: [values]}."""
    filters = {}
    for spec in specs or []:
        for part in spec.split(";"):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise SystemExit(f"--filter: expected key=value[,value...], got {part!r}")
            key, values = part.split("=", 1)
            key = key.strip()
            if key not in ("impl", "dtype", "T", "V", "entropy", "mask"):
                raise SystemExit(f"--filter: unknown key {key!r} "
                                 "(impl, dtype, T, V, entropy, mask)")
            vals = [v.strip() for v in values.split(",") if v.strip()]
            if key == "dtype":
                vals = [_DTYPE_ALIASES.get(v.lower(), v) for v in vals]
            elif key in ("T", "V"):
                vals = [int(v) for v in vals]
            elif key in ("entropy", "mask"):
                vals = [BOOL[v.lower()] for v in vals]
            filters.setdefault(key, []).extend(vals)
    return filters


def impl_selected(impl, patterns):
    """Whether `impl` is run: without a pattern, the DEFAULT_IMPLS; with patterns, every
    implementation a pattern matches (fnmatch globs, e.g. `jaxops-*`: all four Pallas rows)."""
    if patterns is None:
        return impl in DEFAULT_IMPLS
    return any(fnmatch.fnmatch(impl, pattern) for pattern in patterns)


def case_selected(case, filters):
    if not impl_selected(case.impl, filters.get("impl")):
        return False
    for key, vals in filters.items():
        value = getattr(case, key)
        if key == "impl":
            continue
        elif value not in vals:
            return False
    return True


def is_big(T, V):
    return T * V * 4 > 8 * 2**30  # fp32 logits over 8 GiB


def build_cases(mode, filters):
    """Cases in run order: size groups by priority, except that the cases of the big sizes
    that allocate from torch's pool (TORCH_POOL_IMPLS) come first of all, while JAX's memory
    pool is still small (runner.py's doc): they need tens of GB, and JAX's pool never
    shrinks (a run that put the bridge after the JAX rows at T = 32768: JAX held
    135 GB, 13.6 GB were free, the bridge's gradient did not fit). Their torch.compile
    graphs (T dynamic) are the ones the later sizes reuse, so this costs no extra compiles."""
    cases = []
    for T, V, combos in size_groups(mode):
        for impl in IMPLS:
            for dtype, entropy, mask in combos:
                case = Case(impl, dtype, T, V, entropy, mask)
                if impl == MOSAIC_U8 and not mask:
                    continue  # the same call as jaxops-pallas_mosaic's
                once = ("bfloat16", True, True) if impl == MOSAIC_U8 else ("float32", False, False)
                if (mode == "tiny" and impl in PALLAS_IMPLS and "impl" not in filters
                        and ((dtype, entropy, mask) != once
                             or any(c.impl == impl for c in cases))):
                    # Interpret mode is slow (CPU): once per backend; the op's tests cover it.
                    continue
                if case_selected(case, filters):
                    cases.append(case)
    front = [c for c in cases if c.impl in TORCH_POOL_IMPLS and is_big(c.T, c.V)]
    return front + [c for c in cases if c not in front]
