"""Developer tools: kernel tuning and profiling, the backend-choice measurements behind
`implementation="pallas"`'s pick, and scripts that run a GPU session in one device call.

    python -m benchmarks.tools.tune --help          # Triton kernel configs
    python -m benchmarks.tools.mosaic_tune --help   # Mosaic kernel configs, or the API
    python -m benchmarks.tools.backend_choice       # Triton vs Mosaic per shape
    python -m benchmarks.tools.kernel_asm --out F   # the Mosaic kernels as text

Run by path (`python benchmarks/tools/tune.py`) each puts the repository root first on
sys.path, as benchmarks/__init__.py describes.
"""
