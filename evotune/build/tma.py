"""TMA tensor maps (CUtensorMap) for the Hopper kernels, encoded with the driver's
cuTensorMapEncodeTiled through ctypes (CuPy does not wrap it).

`tiled_map_args` is pure (what the map describes, checked on the CPU); `encode_tiled` calls
the driver and needs libcuda, i.e. a GPU machine. A map holds the tensor's address, so it is
made per input buffer, like the rest of a launch's arguments; `map_param` keeps the last few
(address, args) -> map, since a caching allocator hands the same addresses back call after call.
The kernels take the maps by value (`const __grid_constant__ CUtensorMap`), so a launch copies
them into the kernel's parameter space: nothing is uploaded, and a CUDA graph records them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

from ..errors import EvotuneError

# cuda.h enums (CUDA 12/13): CUtensorMapDataType, ...Interleave, ...Swizzle, ...L2promotion, ...FloatOOBfill.
DATA_TYPE = {"fp16": 6, "bf16": 9}
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3
L2_PROMOTION_256B = 3
OOB_FILL_ZERO = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: elements outside the tensor read as zero
TENSOR_MAP_BYTES = 128


@dataclass(frozen=True)
class TiledMapArgs:
    """A rank-4 tiled map over a (batch, head, seq, dim) tensor, innermost dimension first."""

    dtype: str
    dims: tuple[int, int, int, int]        # (dim, seq, heads, batch) elements
    strides: tuple[int, int, int]          # bytes of one step in seq, head, batch
    box: tuple[int, int, int, int]         # (64 columns, rows, 1, 1)


def tiled_map_args(dtype: str, shape_bhsd: tuple[int, int, int, int], strides_bhsd: tuple[int, int, int, int],
                   box_rows: int, box_cols: int = 64) -> TiledMapArgs:
    """The map of a (B, H, S, D) view with element strides `strides_bhsd` (D's must be 1), read in
    boxes of `box_cols` x `box_rows` with the 128-byte swizzle. Raises EvotuneError where TMA cannot
    describe the tensor (its rules: 16-byte multiple strides, boxes of at most 256 per dimension,
    a swizzled box row of at most 128 bytes)."""
    b, h, s, d = shape_bhsd
    sb, sh, ss, sd = strides_bhsd
    elem = 2
    if sd != 1:
        raise EvotuneError("TMA: the head dimension must be contiguous")
    strides = (ss * elem, sh * elem, sb * elem)
    for name, value in zip(("seq", "head", "batch"), strides):
        if value % 16 or value <= 0 or value >= 1 << 40:
            raise EvotuneError(f"TMA: the {name} stride ({value} B) must be a positive multiple of 16 below 2^40")
    if not 0 < box_rows <= 256 or box_cols * elem > 128:
        raise EvotuneError(f"TMA: box {box_cols}x{box_rows} is out of range for the 128-byte swizzle")
    return TiledMapArgs(dtype=dtype, dims=(d, s, h, b), strides=strides, box=(box_cols, box_rows, 1, 1))


_libcuda = None


def _driver():
    global _libcuda
    if _libcuda is None:
        try:
            _libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise EvotuneError(f"TMA: the CUDA driver library is not available ({exc})") from None
        fn = _libcuda.cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return _libcuda


def encode_tiled(address: int, args: TiledMapArgs) -> bytes:
    """The 128-byte CUtensorMap of `args` over the tensor at device `address`."""
    lib = _driver()
    out = (ctypes.c_uint8 * (TENSOR_MAP_BYTES + 128))()  # room to align the map to 128 B (CUDA 13's CUtensorMap)
    base = (ctypes.addressof(out) + 127) & ~127
    dims = (ctypes.c_uint64 * 4)(*args.dims)
    strides = (ctypes.c_uint64 * 3)(*args.strides)
    box = (ctypes.c_uint32 * 4)(*args.box)
    elem_strides = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    rc = lib.cuTensorMapEncodeTiled(ctypes.c_void_p(base), DATA_TYPE[args.dtype], 4, ctypes.c_void_p(address),
                                    dims, strides, box, elem_strides, INTERLEAVE_NONE, SWIZZLE_128B,
                                    L2_PROMOTION_256B, OOB_FILL_ZERO)
    if rc != 0:
        raise EvotuneError(f"TMA: cuTensorMapEncodeTiled failed with CUresult {rc} for {args}")
    return ctypes.string_at(base, TENSOR_MAP_BYTES)


def param(blob: bytes):
    """A 128-byte map as a CuPy kernel argument passed by value: a one-element numpy array of a 128-byte
    void dtype (CuPy hands a size-one numpy array's data to cuLaunchKernel, which copies as many bytes as
    the cubin's parameter takes: 128 for a CUtensorMap). Read-only: it views `blob`."""
    import numpy as np

    if len(blob) != TENSOR_MAP_BYTES:
        raise EvotuneError(f"TMA: a tensor map is {TENSOR_MAP_BYTES} bytes, got {len(blob)}")
    return np.frombuffer(blob, dtype=np.dtype((np.void, TENSOR_MAP_BYTES)))


@lru_cache(maxsize=256)
def map_param(address: int, args: TiledMapArgs):
    """`param(encode_tiled(address, args))`, remembered: a map depends on nothing else."""
    return param(encode_tiled(address, args))
