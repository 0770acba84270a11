"""evotune: autotune and evolve templated CUDA kernels."""

__version__ = "0.1.0"
