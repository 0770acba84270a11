"""A kernel's parameters packed once, patched per call, launched through the CUDA driver.

CuPy's RawKernel call converts each argument to a C value on every launch (about 20 us for the
attention entry's 25 parameters, measured on the H100 through `tools/op_host_overhead.py`). The PyTorch
op launches the same (kernel, shape, strides) call again and again, and between two such calls only
the buffer addresses change. A ParamPacket holds every parameter as a C value in memory of its own
and the array of their addresses that cuLaunchKernel reads (`kernelParams`); a call rewrites the
addresses that changed and launches. cuLaunchKernel copies the values at the call (and a CUDA graph
capture records them), so the packet may be rewritten at once for the next launch.

A packet is not for two threads at once: callers keep one per thread.
"""

from __future__ import annotations

import ctypes

TENSOR_MAP_BYTES = 128

_C_TYPES = {"ptr": ctypes.c_uint64, "i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float,
            "u32": ctypes.c_uint32}
KINDS = tuple(_C_TYPES) + ("map",)


class ParamPacket:
    """The parameters `params` ((name, kind) in entry order; kinds in KINDS) with initial `values`
    (name -> int or float; a "map" -> a 128-byte numpy record). `kernel_params` is the address to pass
    as cuLaunchKernel's kernelParams."""

    def __init__(self, params, values: dict):
        self._slots: dict[str, object] = {}
        pointers = (ctypes.c_void_p * len(params))()
        for i, (name, kind) in enumerate(params):
            if kind == "map":
                slot = (ctypes.c_ubyte * TENSOR_MAP_BYTES)()
                ctypes.memmove(slot, values[name].ctypes.data, TENSOR_MAP_BYTES)
            elif kind in _C_TYPES:
                slot = _C_TYPES[kind](values[name])
            else:
                raise ValueError(f"parameter {name}: unknown kind {kind!r} (kinds: {', '.join(KINDS)})")
            self._slots[name] = slot
            pointers[i] = ctypes.addressof(slot)
        self._pointers = pointers  # the slots and this array live as long as the packet
        self.kernel_params = ctypes.addressof(pointers)

    def slot(self, name: str):
        """The ctypes value of parameter `name`: set `.value` to change it (scalars), or copy into it (maps)."""
        return self._slots[name]

    def set_map(self, name: str, record) -> None:
        """Copy a 128-byte tensor-map record (numpy) into parameter `name`."""
        ctypes.memmove(self._slots[name], record.ctypes.data, TENSOR_MAP_BYTES)

    def as_bytes(self, name: str) -> bytes:
        """The bytes parameter `name` holds now (what the launch will copy)."""
        slot = self._slots[name]
        return ctypes.string_at(ctypes.addressof(slot), ctypes.sizeof(slot))


def launch_packet(function_ptr: int, grid, block, shared_mem: int, stream_handle: int, packet: ParamPacket,
                  pdl: bool = False) -> None:
    """cuLaunchKernel(function, grid, block, shared_mem, stream, packet) (CuPy's driver binding; a
    failure raises its CUDADriverError). The function's context must be current: the op has allocated
    its output on that device just before, which makes torch's (the primary) context current. With `pdl`
    (a kernel compiled with programmatic dependent launch's wait: LaunchPlan.pdl) it is cuLaunchKernelEx with
    programmatic stream serialization instead (evotune.build.launch_ex; a failure raises its LaunchExError)."""
    if pdl:
        from ..build.launch_ex import launch_config, launch_ex

        launch_ex(function_ptr, launch_config(grid, block, shared_mem, stream_handle, pdl=True), packet.kernel_params)
        return
    global _launch_kernel
    if _launch_kernel is None:  # imported once, not per launch (the op's host cost per call)
        from cupy.cuda import driver

        _launch_kernel = driver.launchKernel
    _launch_kernel(function_ptr, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_mem,
                   stream_handle, packet.kernel_params, 0)


_launch_kernel = None
