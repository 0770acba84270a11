"""CPU tests of the Hopper attention variant (mma = wgmma): template inlining, real NVRTC compiles for sm_90a
with ptxas's verdicts, the SASS it turns into, TMA tensor-map arguments, launch geometry and export."""

from __future__ import annotations

import json
import sys

import pytest

from evotune.build.compile import compile_source, complete_elf, static_violations
from evotune.errors import EvotuneError, UsageError
from evotune.problems.shapes import parse_shape
from evotune.build.template import instantiate
from _paths import REPO_ROOT
from _variant_pairs import serialised_notes

W = dict(mma="wgmma", smem_layout="swizzle")
# The committed llama-4k winner (runs/llama-4k-h100-hopper) and a spread of the variant's code paths.
WINNER = dict(W, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=3, q_in_regs=False)
SPREAD = [
    ("4,32,4096,128", WINNER),
    ("4,32,4096,128:bf16:causal", dict(W, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=3,
                                       q_in_regs=True, pingpong=True)),
    ("16,12,1024,64", dict(W, block_m=64, block_n=128, compute_warps=4, producer_warps=0, stages=2, q_in_regs=False)),
    ("2,16,8192,64:bf16", dict(W, block_m=128, block_n=64, compute_warps=8, producer_warps=0, stages=4,
                               q_in_regs=True, pingpong=True)),
    ("1,2,197,300,64:causal:bshd", dict(W, block_m=64, block_n=32, compute_warps=4, producer_warps=4, stages=1,
                                        q_in_regs=True)),
    # Three consumer warpgroups (192 rows): the long-8k search's winner (runs/long-8k-h100-hopper3), and without
    # a producer.
    ("2,16,8192,64", dict(W, block_m=192, block_n=128, compute_warps=12, producer_warps=4, stages=2, q_in_regs=False)),
    ("16,12,1024,64:bf16:causal", dict(W, block_m=192, block_n=64, compute_warps=12, producer_warps=0, stages=3,
                                       q_in_regs=False)),
    # 176-key tiles (FlashAttention-3's d128 non-causal tile), with and without ping-pong.
    ("4,32,4096,128", dict(W, block_m=128, block_n=176, compute_warps=8, producer_warps=4, stages=2, q_in_regs=False,
                           pingpong=True)),
    ("1,3,300,333,128:bf16:bshd", dict(W, block_m=128, block_n=176, compute_warps=8, producer_warps=4, stages=2,
                                       q_in_regs=False)),
]
# ptxas's notes when it cannot keep wgmma asynchronous: C7514/C7515 serialise every wgmma (a 25% loss on
# llama-4k before the loop was restructured), C7519 inserts a fence of its own.


def _compile(attention, space, shape_text, cfg):
    shape = parse_shape(shape_text)
    config = space.config(cfg)
    assert not space.violations(config, attention.context(shape))
    src = instantiate(attention, config, shape)
    return shape, config, src, compile_source(src.code, src.entry)


def test_template_inlines_its_local_headers(attention, space):
    """The instantiated source is self-contained: attention_hopper.cuh and wgmma.cuh are inlined, no local include is left."""
    src = instantiate(attention, space.config(WINNER), parse_shape("llama-4k"))
    assert "// ---- begin attention_hopper.cuh" in src.code and "// ---- begin wgmma.cuh" in src.code
    assert '#include "' not in src.code
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in src.code


def test_include_errors_are_one_line(tmp_path, monkeypatch, attention, space, mission):
    """A missing local header or an include cycle is a UsageError naming the files."""
    monkeypatch.setenv("EVOTUNE_KERNELS", str(tmp_path))
    (tmp_path / "attention.cu").write_text('#include "nowhere.cuh"\n')
    with pytest.raises(UsageError, match=r"nowhere.cuh: kernel template not found \(included from attention.cu\)"):
        instantiate(attention, space.default_config(), mission)
    (tmp_path / "attention.cu").write_text('#include "a.cuh"\n')
    (tmp_path / "a.cuh").write_text('#include "attention.cu"\n')
    with pytest.raises(UsageError, match="#include cycle through attention.cu -> a.cuh -> attention.cu"):
        instantiate(attention, space.default_config(), mission)


def test_generated_wgmma_header_is_current():
    """kernels/wgmma.cuh and wgmma_wide.cuh are what tools/gen_wgmma.py writes today."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    try:
        import gen_wgmma
    finally:
        sys.path.pop(0)
    assert (REPO_ROOT / "kernels" / "wgmma.cuh").read_text() == gen_wgmma.render()
    assert (REPO_ROOT / "kernels" / "wgmma_wide.cuh").read_text() == gen_wgmma.render_wide()


@pytest.mark.parametrize("shape_text,cfg", SPREAD, ids=[s for s, _ in SPREAD])
def test_hopper_configs_compile_async_and_clean(attention, space, shape_text, cfg):
    """Each path of the variant compiles for sm_90a without spills or local memory, and ptxas keeps its wgmma
    asynchronous (no serialisation note); with a producer warpgroup and two consumers the kernel is built at the
    launch bound, 168 registers, which setmaxnreg then splits 24/240; with three, 128 (split 32/160)."""
    shape, config, _, compiled = _compile(attention, space, shape_text, cfg)
    res = compiled.resources
    geo = attention.geometry(config, shape)
    assert static_violations(res, geo.threads, geo.dynamic_smem) == []
    notes = serialised_notes(compiled)
    assert notes == []
    if cfg["producer_warps"] == 4 and cfg["compute_warps"] == 8:
        assert geo.threads == 384 and res.registers == 168
    if cfg["producer_warps"] == 4 and cfg["compute_warps"] == 12:
        assert geo.threads == 512 and res.registers == 128


def test_geometry_matches_the_space(attention, space):
    """Launch geometry of a wgmma config: 64 rows per consumer warpgroup, the producer warpgroup's threads, and the
    shared memory the space's smem_bytes derives."""
    shape = parse_shape("2,5,1000,128:bf16")
    config = space.config(dict(WINNER, stages=2))
    geo = attention.geometry(config, shape)
    assert geo.grid == (8, 5, 2) and geo.block == (384, 1, 1)
    assert geo.dynamic_smem == space.derive(config, attention.context(shape))["smem_bytes"] == 2 * 128 * (128 + 512) + 1024
    assert attention.workspace_elems(config, shape) == (0, 0, 0)


def test_tensor_map_arguments_for_both_layouts(attention, space):
    """The Q/K/V maps are rank 4 (head_dim, seq, head, batch) with byte strides from the tensor's own strides
    (BHSD or BSHD), boxes of 64 columns by block_m (Q) or block_n (K, V) rows."""
    config = space.config(WINNER)
    shape = parse_shape("2,3,100,200,128:bf16:bshd")
    strides = {"q": (100 * 3 * 128, 128, 3 * 128, 1), "k": (200 * 3 * 128, 128, 3 * 128, 1), "v": (200 * 3 * 128, 128, 3 * 128, 1)}
    maps = attention.tensor_map_args(config, shape, strides)
    assert maps["q"].dims == (128, 100, 3, 2) and maps["k"].dims == (128, 200, 3, 2)
    assert maps["q"].strides == (3 * 128 * 2, 128 * 2, 100 * 3 * 128 * 2)
    assert maps["q"].box == (64, 128, 1, 1) and maps["v"].box == (64, 128, 1, 1) and maps["k"].dtype == "bf16"


def test_tensor_map_rules_are_enforced():
    """TMA's rules come back as one-line errors: contiguous head dim, 16-byte multiple strides, box limits."""
    from evotune.build.tma import tiled_map_args

    ok = tiled_map_args("fp16", (1, 2, 64, 64), (8192, 4096, 64, 1), 64)
    assert ok.strides == (128, 8192, 16384)
    with pytest.raises(EvotuneError, match="head dimension must be contiguous"):
        tiled_map_args("fp16", (1, 2, 64, 64), (8192, 4096, 1, 64), 64)
    with pytest.raises(EvotuneError, match="seq stride .* multiple of 16"):
        tiled_map_args("fp16", (1, 2, 64, 60), (8192, 4096, 60, 1), 64)
    with pytest.raises(EvotuneError, match="box 64x512"):
        tiled_map_args("fp16", (1, 2, 64, 64), (8192, 4096, 64, 1), 512)


def test_cupy_cubin_is_completed(attention, space, mission):
    """compile_source writes the whole ELF (CuPy's getCUBIN returns it one byte short); complete_elf is idempotent
    and leaves non-ELF bytes alone."""
    import struct

    src = instantiate(attention, space.default_config(), mission)
    data = open(compile_source(src.code, src.entry).cubin_path, "rb").read()
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    assert len(data) >= max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    assert complete_elf(data) == data
    assert complete_elf(data[:-1]) == data[:-1] + b"\x00" and data[-1] == 0
    assert complete_elf(b"not an elf") == b"not an elf"


def test_sass_shows_wgmma_tma_and_no_local_memory(attention, space, cuobjdump):
    """The Hopper winner's SASS runs HGMMA and TMA loads (UTMALDG) and no HMMA, cp.async or local memory;
    an mma.sync config's runs HMMA, ldmatrix and cp.async and no HGMMA."""
    from evotune.build.sass import disassemble, summary

    *_, compiled = _compile(attention, space, "llama-4k", WINNER)
    hopper = summary(disassemble(compiled.cubin_path))
    assert hopper["tensor_core"] == "wgmma" and hopper["local_memory"] == 0
    c = hopper["classes"]
    assert c["HGMMA"] >= 16 and c["UTMALDG"] > 0 and c["SYNCS"] > 0 and c["HMMA"] == c["LDGSTS"] == 0
    *_, compiled = _compile(attention, space, "llama-4k", dict(block_m=128, block_n=32, compute_warps=4, q_in_regs=False))
    sync = summary(disassemble(compiled.cubin_path))["classes"]
    assert sync["HMMA"] > 0 and sync["LDSM"] > 0 and sync["LDGSTS"] > 0 and sync["HGMMA"] == sync["UTMALDG"] == 0


def test_sass_command(main_in_process, tmp_path, cuobjdump):
    """`evotune sass --config ... --json` reports wgmma and no local memory and writes the listing; a config the
    space refuses is a usage error (exit 2)."""
    listing = tmp_path / "winner.sass"
    proc = main_in_process("sass", "--config", json.dumps(WINNER), "--shape", "llama-4k", "--json", "-o", str(listing))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["tensor_core"] == "wgmma" and info["local_memory"] == 0 and info["spill_bytes"] == 0
    assert "HGMMA" in listing.read_text()
    proc = main_in_process("sass", "--config", json.dumps(dict(WINNER, block_m=64)), "--shape", "llama-4k")
    assert proc.returncode == 2 and "not admitted" in proc.stderr


def test_export_of_a_wgmma_config_says_how_to_launch_it(attention, space):
    """An exported Hopper config names its own entry signature (tensor maps, output, strides) and the maps to build."""
    from evotune.build.export import export_source

    text = export_source(attention, parse_shape("llama-4k"), space.config(WINNER))
    header = [line for line in text.splitlines() if line.startswith("// ")][:12]
    assert any("signature    evotune_attention(const __grid_constant__ CUtensorMap q_map, k_map, v_map" in line
               for line in header)
    assert any("passed by value" in line for line in header)
    assert any(line.startswith("// tensor maps  cuTensorMapEncodeTiled, rank 4") and "64 x 128 (Q)" in line for line in header)
    assert "evotune::hopper::attention_fwd_wgmma<EvotuneTraits>" in text


def _kparams(cuobjdump: str, cubin_path: str) -> dict[int, tuple[int, int]]:
    """ordinal -> (offset, size) of the entry's kernel parameters, from `cuobjdump -elf` (EIATTR_KPARAM_INFO)."""
    import re
    import subprocess

    text = subprocess.run([cuobjdump, "-elf", cubin_path], capture_output=True, text=True, check=True).stdout
    return {int(o, 16): (int(off, 16), int(size, 16)) for o, off, size in
            re.findall(r"Ordinal\s*:\s*(0x[0-9a-f]+)\s+Offset\s*:\s*(0x[0-9a-f]+)\s+Size\s*:\s*(0x[0-9a-f]+)", text)}


def test_tensor_maps_are_by_value_kernel_parameters(attention, space, cuobjdump):
    """The wgmma entry takes Q, K, V's CUtensorMaps by value: its first three parameters are 128 bytes each on
    128-byte aligned offsets, then o's pointer, three int64 strides, two ints and a float; the SASS reads no
    descriptor from global memory (UTMALDG and prefetch take the parameter-space maps)."""
    from evotune.build.sass import disassemble, summary

    for shape_text, cfg in (SPREAD[0], SPREAD[-1]):
        *_, compiled = _compile(attention, space, shape_text, cfg)
        params = _kparams(cuobjdump, compiled.cubin_path)
        assert [params[i][1] for i in range(10)] == [128, 128, 128, 8, 8, 8, 8, 4, 4, 4], params
        offsets = [params[i][0] for i in range(3)]
        assert offsets[1] - offsets[0] == offsets[2] - offsets[1] == 128 and params[3][0] == offsets[2] + 128
        info = summary(disassemble(compiled.cubin_path))
        assert info["classes"]["UTMALDG"] > 0 and info["local_memory"] == 0


def test_tensor_map_param_is_a_128_byte_record():
    """tma.param makes a one-element numpy array of 128 bytes (what CuPy passes by value), viewing the map's bytes."""
    import numpy as np

    from evotune.build.tma import param

    blob = bytes(range(128))
    arg = param(blob)
    assert isinstance(arg, np.ndarray) and arg.size == 1 and arg.itemsize == 128 and arg.tobytes() == blob
    with pytest.raises(EvotuneError, match="128 bytes"):
        param(blob[:64])


def test_wgmma_export_compiles_with_nvcc_alone(attention, space, tmp_path):
    """An exported Hopper config (CUtensorMap parameters from <cuda.h>) compiles with its header's build line alone
    (nvcc 13's plain -arch=sm_90a would also emit compute_90 PTX, where wgmma does not exist)."""
    import shutil
    import subprocess

    from evotune.build.export import export_source, write_export

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    src = write_export(tmp_path / "hopper.cu", export_source(attention, parse_shape("llama-4k"), space.config(WINNER)))
    text = src.read_text()
    assert "// build        nvcc -gencode arch=compute_90a,code=sm_90a -c THIS_FILE.cu" in text
    proc = subprocess.run([nvcc, "-gencode", "arch=compute_90a,code=sm_90a", "-c", src.name, "-o", "hopper.o"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert b"evotune_attention" in (tmp_path / "hopper.o").read_bytes()


@pytest.mark.parametrize("shape_text, kv_magic", [("1,2,197,300,64:causal:bshd", 0),
                                                   ("1,4,197,300,64:causal:bshd:kv2", 1 << 31)])
def test_launch_plan_and_wgmma_args_are_memoised(attention, space, monkeypatch, shape_text, kv_magic):
    """A launch's tensor-independent part (grid, block, shared memory) is worked out once per (config, shape), and
    a wgmma launch passes Q, K, V's maps as three 128-byte by-value records, each encoded once per (address, layout),
    then the K/V group's magic (0 without grouped-query attention; K's and V's maps then span the K/V heads), the
    query heads and batch, and a null tile_counter."""
    import numpy as np

    import evotune.build.compile
    import evotune.build.tma as tma

    shape = parse_shape(shape_text)
    config = space.config(SPREAD[-1][1])
    plan = attention.launch_plan(config, shape)
    assert plan is attention.launch_plan(space.config(SPREAD[-1][1]), shape)
    geo = attention.geometry(config, shape)
    assert (plan.grid, plan.block, plan.dynamic_smem) == (tuple(geo.grid), tuple(geo.block), geo.dynamic_smem)

    encoded = []
    monkeypatch.setattr(tma, "encode_tiled", lambda address, args: encoded.append((address, args)) or bytes(128))
    tma.map_param.cache_clear()
    launched = []
    monkeypatch.setattr(evotune.build.compile, "torch_stream_launcher",
                        lambda kernel, grid, block, args, smem, keep=(), pdl=False:
                        launched.append((grid, block, args, smem)))
    inputs = attention.make_inputs(shape, 0, device="cpu")  # (B, S, H, D) memory: CPU tensors, never launched
    out = attention.new_output(inputs)
    for _ in range(3):
        attention.launcher(None, config, shape, inputs, out)
    assert len(encoded) == 3 and [a for _, a in encoded] == list(attention.tensor_map_args(
        config, shape, {n: tuple(inputs[n].stride()) for n in "qkv"}).values())
    grid, block, args, smem = launched[-1]
    assert (grid, block, smem) == (plan.grid, plan.block, plan.dynamic_smem) and len(args) == 14
    assert all(isinstance(a, np.ndarray) and a.size == 1 and a.itemsize == 128 for a in args[:3])
    assert int(args[3]) == out.data_ptr() and [int(a) for a in args[4:7]] == list(out.stride()[:3])
    assert (int(args[7]), int(args[8])) == (197, 300) and isinstance(args[9], np.float32)
    assert isinstance(args[10], np.uint32) and int(args[10]) == kv_magic
    assert [int(a) for a in args[11:]] == [shape.heads, shape.batch, 0]  # one-tile grid: no tile counters
    assert [a.dims[2] for _, a in encoded] == [shape.heads, shape.kv_heads, shape.kv_heads]
    tma.map_param.cache_clear()
