"""Tests for evotune.build.launch_ex (cuLaunchKernelEx through ctypes) on the CPU: the structures' layout against
cuda.h, the attribute a PDL launch carries, the packed arguments, and the error naming the CUresult."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from evotune.build import launch_ex as L

# sizeof and offsetof in cuda.h (CUDA 12.0 to 13.x, 64-bit): the attribute is its 4-byte id, 4 bytes of pad and a
# 64-byte value union; the config is seven unsigned ints, the stream (after 4 bytes of alignment), the attribute
# pointer and their count.
LAYOUT = {"sizeof(CUlaunchAttributeValue)": 64, "sizeof(CUlaunchAttribute)": 72,
          "offsetof(CUlaunchAttribute, value)": 8, "sizeof(CUlaunchConfig)": 56,
          "offsetof(CUlaunchConfig, sharedMemBytes)": 24, "offsetof(CUlaunchConfig, hStream)": 32,
          "offsetof(CUlaunchConfig, attrs)": 40, "offsetof(CUlaunchConfig, numAttrs)": 48}


def ctypes_layout() -> dict:
    return {"sizeof(CUlaunchAttributeValue)": ctypes.sizeof(L.CUlaunchAttributeValue),
            "sizeof(CUlaunchAttribute)": ctypes.sizeof(L.CUlaunchAttribute),
            "offsetof(CUlaunchAttribute, value)": L.CUlaunchAttribute.value.offset,
            "sizeof(CUlaunchConfig)": ctypes.sizeof(L.CUlaunchConfig),
            "offsetof(CUlaunchConfig, sharedMemBytes)": L.CUlaunchConfig.sharedMemBytes.offset,
            "offsetof(CUlaunchConfig, hStream)": L.CUlaunchConfig.hStream.offset,
            "offsetof(CUlaunchConfig, attrs)": L.CUlaunchConfig.attrs.offset,
            "offsetof(CUlaunchConfig, numAttrs)": L.CUlaunchConfig.numAttrs.offset}


def test_structures_have_cuda_h_layout():
    """The ctypes structures have cuda.h's sizes and offsets, and the union the 8-byte alignment of its pointers."""
    assert ctypes_layout() == LAYOUT
    assert ctypes.alignment(L.CUlaunchAttributeValue) == 8


def _cuda_header():
    from evotune.build.compile import cuda_include_dirs

    for folder in cuda_include_dirs():
        if (header := Path(folder) / "cuda.h").exists():
            return header
    return None


def test_structures_match_the_installed_cuda_h(tmp_path):
    """Where a cuda.h and a C compiler are at hand, the header itself agrees: compiled sizeof/offsetof, and the
    attribute's id (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6)."""
    header, cc = _cuda_header(), shutil.which("cc") or shutil.which("gcc")
    if header is None or cc is None:
        pytest.skip("no cuda.h or no C compiler here")
    text = header.read_text()
    assert re.search(r"CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION\s*=\s*6\b", text)
    lines = "".join(f'    printf("%s=%zu\\n", "{what}", (size_t){what});\n' for what in LAYOUT)
    (tmp_path / "layout.c").write_text(f"#include <stdio.h>\n#include <stddef.h>\n#include <cuda.h>\n"
                                       f"int main(void) {{\n{lines}    printf(\"id=%d\\n\", "
                                       f"(int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n    return 0;\n}}\n")
    build = subprocess.run([cc, "-I", str(header.parent), str(tmp_path / "layout.c"), "-o", str(tmp_path / "layout")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    said = dict(line.split("=", 1) for line in subprocess.run([str(tmp_path / "layout")], capture_output=True,
                                                              text=True, check=True).stdout.splitlines())
    assert {k: int(v) for k, v in said.items()} == {**LAYOUT, "id": L.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION}


def test_launch_config_carries_programmatic_serialization():
    """A pdl launch's config has one attribute, programmatic stream serialization = 1; a plain one none; stream 0
    (the legacy default stream) is a null handle."""
    config = L.launch_config((16, 8, 1), (128, 1, 1), 49152, 0x1234, pdl=True)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (16, 8, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ, config.sharedMemBytes) == (128, 1, 1, 49152)
    assert config.hStream == 0x1234 and config.numAttrs == 1
    attr = config.attrs[0]
    assert attr.id == 6 and attr.value.programmaticStreamSerializationAllowed == 1
    assert ctypes.string_at(ctypes.addressof(attr.value), 8) == (1).to_bytes(8, "little")  # the int, the rest zero
    plain = L.launch_config((1, 1, 1), (32, 1, 1), 0, 0, pdl=False)
    assert plain.numAttrs == 0 and not plain.attrs and plain.hStream is None


def test_arg_pack_holds_each_value_and_their_addresses():
    """kernelParams from CuPy-style arguments: each numpy scalar's (and a 128-byte record's) bytes, pointed at in order."""
    record = np.frombuffer(bytes(range(128)), dtype=np.dtype((np.void, 128)))
    args = (np.uint64(0xDEADBEEF00), np.int64(-3), np.int32(7), np.float32(0.5), np.uint32(9), record)
    pack = L.ArgPack(args)
    pointers = (ctypes.c_void_p * len(args)).from_address(pack.kernel_params)
    for i, a in enumerate(args):
        assert pack.as_bytes(i) == a.tobytes()
        assert ctypes.string_at(pointers[i], len(a.tobytes())) == a.tobytes()
    assert L.ArgPack(()).kernel_params is None
    with pytest.raises(TypeError, match="numpy scalar"):
        L.ArgPack((3,))


class FakeDriver:
    """libcuda's three functions as launch_ex calls them: cuLaunchKernelEx returns `code`."""

    def __init__(self, code: int):
        self.code, self.calls = code, []

    def cuLaunchKernelEx(self, config_ref, function, params, extra):
        config = config_ref._obj
        self.calls.append((config.numAttrs, config.attrs[0].id if config.numAttrs else None, function, params))
        return self.code

    def cuGetErrorName(self, code, out):
        out._obj.value = {1: b"CUDA_ERROR_INVALID_VALUE"}.get(code)
        return 0 if code == 1 else 1

    def cuGetErrorString(self, code, out):
        out._obj.value = b"invalid argument" if code == 1 else None
        return 0


def test_launch_ex_passes_the_config_and_names_a_failure(monkeypatch):
    """A launch hands the config, function and kernelParams to cuLaunchKernelEx; an error raises LaunchExError
    naming the CUresult (cuGetErrorName and cuGetErrorString), or its number where the driver knows no name."""
    ok = FakeDriver(0)
    monkeypatch.setattr(L, "_driver", lambda: ok)
    L.launch_ex(0xF00, L.launch_config((1, 1, 1), (32, 1, 1), 0, 0, pdl=True), 0xBA5E)
    assert ok.calls == [(1, 6, 0xF00, 0xBA5E)]
    monkeypatch.setattr(L, "_driver", lambda: FakeDriver(1))
    with pytest.raises(L.LaunchExError, match=r"cuLaunchKernelEx \(programmatic stream serialization on\) failed: "
                                              r"CUDA_ERROR_INVALID_VALUE \(1\): invalid argument"):
        L.launch_ex(0xF00, L.launch_config((1, 1, 1), (32, 1, 1), 0, 0, pdl=True), None)
    monkeypatch.setattr(L, "_driver", lambda: FakeDriver(999))
    with pytest.raises(L.LaunchExError, match=r"unknown CUresult \(999\)"):
        L.launch_ex(0xF00, L.launch_config((1, 1, 1), (32, 1, 1), 0, 0, pdl=False), None)


def test_packet_launch_takes_the_ex_path_only_with_pdl(monkeypatch):
    """evotune.gpu.packet.launch_packet (the op's launch) goes through launch_ex with the attribute when told pdl."""
    from evotune.gpu import packet as P

    seen = []
    monkeypatch.setattr(L, "launch_ex", lambda fn, config, params: seen.append((fn, config.numAttrs, config.hStream,
                                                                               config.gridDimX, params)))
    pkt = P.ParamPacket((("n", "i32"),), {"n": 3})
    P.launch_packet(0xF00, (5, 1, 1), (64, 1, 1), 0, 0x77, pkt, pdl=True)
    assert seen == [(0xF00, 1, 0x77, 5, pkt.kernel_params)]
