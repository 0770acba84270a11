"""evotune: autotune and evolve templated CUDA kernels."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `evotune.tune_kernel` without importing the search (Optuna, the GPU worker) on `import evotune`: the API module
    # sits on the top floor with the CLI, so the package reaches it by name, on first use.
    if name in ("tune_kernel", "TuneResult", "search_family"):
        import importlib

        return getattr(importlib.import_module("evotune.api"), name)
    raise AttributeError(f"module 'evotune' has no attribute {name!r}")
