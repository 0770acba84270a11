"""Kernel launches that carry a launch attribute: cuLaunchKernelEx through ctypes, for programmatic dependent launch.

A config with pdl true (the attention family's knob, docs/PDL.md) is launched with the attribute
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1, which lets the driver start its grid while the previous
kernel in the stream still runs, once that kernel's CTAs have all executed griddepcontrol.launch_dependents (or
exited); the kernel's griddepcontrol.wait then holds every global access until that kernel has completed. CuPy's
RawKernel call and cupy.cuda.driver.launchKernel go through cuLaunchKernel, which takes no attributes, so this
module calls libcuda's cuLaunchKernelEx itself. A pdl-false config keeps the cuLaunchKernel paths it always had.

The structures are cuda.h's (CUDA 12.0 and later; checked against CUDA 13.0's header by tests/test_launch_ex.py):

    typedef struct CUlaunchAttribute_st {        // 72 bytes
        CUlaunchAttributeID id;                  // an enum: 4 bytes
        char pad[8 - sizeof(CUlaunchAttributeID)];
        CUlaunchAttributeValue value;            // a union padded to 64 bytes, 8-byte aligned (it holds pointers)
    } CUlaunchAttribute;
    typedef struct CUlaunchConfig_st {           // 56 bytes
        unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
        CUstream hStream;                        // offset 32
        CUlaunchAttribute *attrs;                // 40
        unsigned int numAttrs;                   // 48
    } CUlaunchConfig;
    CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra);

A launch copies the parameters and the configuration at the call (and a CUDA graph capture records them, the
attribute as a programmatic edge), so everything here may be reused or changed at once for the next launch. The
function's context must be current on the calling thread, as for cuLaunchKernel: torch's and CuPy's primary one.
"""

from __future__ import annotations

import ctypes
import sys
from functools import lru_cache

from ..errors import EvotuneError

CUDA_SUCCESS = 0
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class CUlaunchAttributeValue(ctypes.Union):
    """cuda.h's CUlaunchAttributeValue: 64 bytes; of its members only programmaticStreamSerializationAllowed is
    written here. The pointer member gives the union the 8-byte alignment its CUevent members give it in C."""

    _fields_ = [("pad", ctypes.c_char * 64), ("_align", ctypes.c_void_p),
                ("programmaticStreamSerializationAllowed", ctypes.c_int)]


class CUlaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", CUlaunchAttributeValue)]


class CUlaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(CUlaunchAttribute)), ("numAttrs", ctypes.c_uint)]


class LaunchExError(EvotuneError):
    """cuLaunchKernelEx returned an error, or the driver library has no cuLaunchKernelEx."""


def programmatic_attrs():
    """A one-element CUlaunchAttribute array: programmatic stream serialization allowed."""
    attrs = (CUlaunchAttribute * 1)()
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[0].value.programmaticStreamSerializationAllowed = 1
    return attrs


_PDL_ATTRS = programmatic_attrs()  # read-only once made: every PDL launch points at it


def launch_config(grid, block, shared_mem: int, stream_handle: int, pdl: bool = True) -> CUlaunchConfig:
    """The CUlaunchConfig of one launch; with `pdl` it carries programmatic stream serialization."""
    config = CUlaunchConfig(int(grid[0]), int(grid[1]), int(grid[2]), int(block[0]), int(block[1]), int(block[2]),
                            int(shared_mem), int(stream_handle) or None)
    if pdl:
        config.attrs, config.numAttrs = _PDL_ATTRS, 1
    return config


@lru_cache(maxsize=1)
def _driver():
    """libcuda with cuLaunchKernelEx, cuGetErrorName and cuGetErrorString typed (loaded on the first launch)."""
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        raise LaunchExError(f"cannot load the CUDA driver library {name} for cuLaunchKernelEx: {e}") from None
    if not hasattr(lib, "cuLaunchKernelEx"):
        raise LaunchExError("the CUDA driver has no cuLaunchKernelEx (driver for CUDA 12.0 or later needed for pdl)")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(CUlaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    for fn in (lib.cuGetErrorName, lib.cuGetErrorString):
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        fn.restype = ctypes.c_int
    return lib


def error_text(lib, code: int) -> str:
    """`CUDA_ERROR_NAME (code): description` from the driver (what cuGetErrorName/String say of `code`)."""
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    known = lib.cuGetErrorName(code, ctypes.byref(name)) == CUDA_SUCCESS and name.value
    lib.cuGetErrorString(code, ctypes.byref(text))
    spelled = name.value.decode() if known else "unknown CUresult"
    return f"{spelled} ({code})" + (f": {text.value.decode()}" if text.value else "")


def launch_ex(function_ptr: int, config: CUlaunchConfig, kernel_params: int) -> None:
    """cuLaunchKernelEx(config, function, kernelParams); LaunchExError naming the CUresult on failure."""
    lib = _driver()
    code = lib.cuLaunchKernelEx(ctypes.byref(config), function_ptr, kernel_params, None)
    if code != CUDA_SUCCESS:
        raise LaunchExError(f"cuLaunchKernelEx (programmatic stream serialization "
                            f"{'on' if config.numAttrs else 'off'}) failed: {error_text(lib, code)}")


class ArgPack:
    """cuLaunchKernel-style kernelParams for arguments as CuPy takes them (numpy scalars; a one-element numpy array
    for a by-value record such as a 128-byte tensor map): each value's bytes copied once into a buffer of its own,
    and the array of their addresses (`kernel_params`). The driver copies as many bytes from each as the
    kernel's parameter takes, so the values' types must be the entry point's (as for CuPy's call)."""

    def __init__(self, args):
        self._buffers = [ctypes.create_string_buffer(data, len(data)) for data in map(_as_bytes, args)]
        pointers = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.addressof(b) for b in self._buffers])
        self._pointers = pointers  # the buffers and this array live as long as the pack
        self.kernel_params = ctypes.addressof(pointers) if args else None

    def as_bytes(self, index: int) -> bytes:
        """The bytes argument `index` holds (what a launch copies)."""
        return self._buffers[index].raw


def _as_bytes(value) -> bytes:
    import numpy as np

    if isinstance(value, (np.generic, np.ndarray)) and value.nbytes:
        return value.tobytes()
    raise TypeError(f"kernel argument {value!r}: pass a numpy scalar or array, as for CuPy's RawKernel call")
