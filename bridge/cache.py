"""`bridge.cache`: the persistent compilation cache, one per-user directory, on by default.

Two kinds of entries live under one root (docs/compilation.md):

* XLA programs (every jitted function of `_jaxfns.py` / `_linear_jaxfns.py`, Pallas
  kernels included): JAX's own persistent compilation cache, pointed at
  `<root>/<versions>/xla`. JAX keys each entry by a hash of the lowered program
  (shapes, dtypes, the kernels' code as lowered), jaxlib's version, the backend and its
  devices, the XLA flags and the compile options.
* The direct route's Mosaic GPU kernels (`_direct._Launcher`), which JAX never sees as
  a program of its own: the lowered kernel module (the bytes handed to Mosaic's
  compiler), in `<root>/<versions>/mosaic`, keyed by the kernel's full configuration,
  its operand shapes, the GPU and a digest of jaxops' and the bridge's sources.

`<versions>` names jax, jaxlib and Python, so an upgrade starts an empty folder
instead of reading entries written by another version.

`JAXOPS_CACHE_DIR=DIR` picks the root, `JAXOPS_CACHE_DIR=off` turns both off; by
default `$XDG_CACHE_HOME/jaxops` (else `~/.cache/jaxops`). A cache dir the user has set
for JAX (`jax_compilation_cache_dir`) is left as it is: JAX's entries go there and the
Mosaic kernels to `<that dir>/jaxops-mosaic`. A directory that cannot be written turns
the cache off with one warning; JAX itself warns and compiles when it cannot read an
entry; an unreadable kernel entry here is rebuilt and rewritten (with a warning).

`enable()` runs before the bridge's first compile (`_dlpack.device`, where JAX is first
asked for a device), not at `import bridge`: a user may still configure JAX's cache
between the import and the first call.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import tempfile
import threading
import warnings

ENV = "JAXOPS_CACHE_DIR"
MAX_BYTES = 8 * 2**30  # JAX's LRU eviction bound for the bridge's own XLA cache
_MAGIC = b"jaxops-kernel-v1\n"

_lock = threading.Lock()
_state: dict = {}  # "done": bool, "root": Path | None, "xla": str | None, "mosaic": Path | None


def _versions() -> str:
    import jax
    import jaxlib

    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"jax-{jax.__version__}_jaxlib-{jaxlib.__version__}_py{py}"


def _default_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jaxops"


def _writable(path: pathlib.Path) -> str | None:
    """None if `path` can be created and written to, else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


def _warn(path, why):
    warnings.warn(f"bridge: compilation cache off: cannot write to {path} ({why}); "
                  f"programs are compiled as usual. Set {ENV}=DIR to another directory, "
                  f"or {ENV}=off to silence this.", RuntimeWarning, stacklevel=3)


def enable() -> pathlib.Path | None:
    """Turn the cache on as configured (once per process); return the Mosaic kernels'
    folder, or None where the cache is off."""
    if _state.get("done"):
        return _state["mosaic"]
    with _lock:
        if not _state.get("done"):
            _state.update(_configure())
            _state["done"] = True
    return _state["mosaic"]


def _configure() -> dict:
    import jax

    off = {"root": None, "xla": None, "mosaic": None}
    setting = os.environ.get(ENV, "").strip()
    user_dir = jax.config.jax_compilation_cache_dir
    if setting.lower() in ("off", "0", "false", "none"):
        return off
    if user_dir:  # the user's JAX cache: theirs to configure; kernels go beside it
        mosaic = pathlib.Path(user_dir) / "jaxops-mosaic" / _versions()
        why = _writable(mosaic)
        if why:
            _warn(mosaic, why)
            mosaic = None
        return {"root": pathlib.Path(user_dir), "xla": user_dir, "mosaic": mosaic}
    root = pathlib.Path(setting).expanduser() if setting else _default_root()
    folder = root / _versions()
    why = _writable(folder / "xla") or _writable(folder / "mosaic")
    if why:
        _warn(folder, why)
        return off
    xla = str(folder / "xla")
    jax.config.update("jax_compilation_cache_dir", xla)
    # The bridge's programs take 0.02-1 s each on the CPU and up to seconds on a GPU;
    # JAX's defaults (>= 1 s) would cache almost none of them.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # A bound turns on JAX's LRU eviction and with it a file lock around each read
    # and write, so processes sharing the folder never read a half-written entry.
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return {"root": root, "xla": xla, "mosaic": folder / "mosaic"}


def directory() -> str | None:
    """The folder JAX's persistent cache writes the bridge's programs to, or None
    (off, or not yet enabled: it is enabled on the bridge's first call)."""
    return _state.get("xla")


# -------------------------------------------------------------- the Mosaic kernels


_source_digest: list = []


def _sources() -> str:
    """A digest of the code that determines a kernel: jaxops' and the bridge's sources
    (an editable install changes them without changing a version number)."""
    if not _source_digest:
        h = hashlib.sha256()
        here = pathlib.Path(__file__).resolve().parent
        for folder in (here.parent / "jaxops", here):
            for path in sorted(folder.glob("*.py")):
                h.update(path.name.encode() + b"\0" + path.read_bytes())
        _source_digest.append(h.hexdigest())
    return _source_digest[0]


def kernel_key(config, structs, device) -> str:
    """The file name of a kernel entry: a hash of everything that determines its module
    -- the kernel factory's arguments `config`, the operand shapes, the GPU, CUDA, the
    Mosaic/XLA environment, the sources (and, in the folder's name, the versions)."""
    import torch

    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith("MOSAIC_GPU") or k == "XLA_FLAGS")
    parts = (_sources(), config, [(tuple(s.shape), str(s.dtype)) for s in structs],
             torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
             torch.version.cuda, env)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def load_kernel(key: str, folder=None) -> tuple[bytes, int] | None:
    """(module bytes, number of results) stored under `key` (in `folder`, default the
    enabled cache's), or None. A damaged entry is reported and treated as missing (the
    caller rebuilds and rewrites it)."""
    folder = enable() if folder is None else pathlib.Path(folder)
    if folder is None:
        return None
    path = folder / key
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        warnings.warn(f"bridge: cannot read cached kernel {path} ({err}); recompiling",
                      RuntimeWarning, stacklevel=2)
        return None
    header_len = len(_MAGIC) + 32 + 4
    body = data[header_len:]
    if (len(data) < header_len or not data.startswith(_MAGIC)
            or hashlib.sha256(body).digest() != data[len(_MAGIC):len(_MAGIC) + 32]):
        warnings.warn(f"bridge: cached kernel {path} is damaged; recompiling it",
                      RuntimeWarning, stacklevel=2)
        return None
    return body, int.from_bytes(data[header_len - 4:header_len], "little")


def store_kernel(key: str, module: bytes, num_results: int, folder=None) -> None:
    """Write an entry atomically (a temporary file renamed into place: concurrent
    writers of one key each rename a complete file; readers never see a partial one)."""
    folder = enable() if folder is None else pathlib.Path(folder)
    if folder is None:
        return
    data = (_MAGIC + hashlib.sha256(module).digest()
            + num_results.to_bytes(4, "little") + module)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, folder / key)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as err:
        warnings.warn(f"bridge: cannot write cached kernel to {folder} ({err})",
                      RuntimeWarning, stacklevel=2)
