"""Tests for evotune.build.compile: real NVRTC compiles of the attention template (no GPU needed),
the cubin cache, the ptxas resource report, and the static checks made before any launch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import evotune.build.compile as compile_module
from evotune.build.compile import (
    DEFAULT_ARCH,
    REGISTERS_PER_SM,
    SMEM_LIMIT_BYTES,
    CompileError,
    Resources,
    compile_source,
    parse_resources,
    static_violations,
)
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import shape_context
from evotune.build.template import instantiate

ELF_MAGIC = b"\x7fELF"

# (id, shape, config overrides): at least one of each code path of the template.
CONFIGS = [
    ("default", "mission", {}),
    ("producer1-stages3-pad", "mission", {"producer_warps": 1, "stages": 3, "smem_layout": "pad"}),
    ("bf16-causal-d128-q-in-smem", "1,8,512,128:bf16:causal", {"q_in_regs": False}),
    ("tiny-one-stage-plain", "mission", {"block_m": 16, "block_n": 16, "compute_warps": 1, "stages": 1,
                                         "smem_layout": "plain"}),
    ("producer2-stages4-8warps", "mission", {"block_m": 128, "block_n": 32, "compute_warps": 8,
                                             "producer_warps": 2, "stages": 4}),
    ("bf16-causal-bn128-pad", "mission:bf16:causal", {"block_m": 32, "block_n": 128, "compute_warps": 2,
                                                     "stages": 3, "smem_layout": "pad"}),
]

# Admitted by the space, but one warp owning 64 query rows with Q in registers needs more than 255
# registers: ptxas spills (255 regs, 40 B). (The 8+1-warp 128x128 tile used here before stopped
# spilling with the loader's register diet.)
SPILLING = ("mission", {"block_m": 64, "block_n": 16, "compute_warps": 1, "producer_warps": 0, "stages": 2,
                        "smem_layout": "swizzle", "q_in_regs": True})


def build(attention, space, shape_text, overrides, **kwargs):
    """Instantiate and compile one config; return (config, shape, source, compiled)."""
    shape = parse_shape(shape_text)
    cfg = space.config(overrides)
    assert space.violations(cfg, shape_context(shape)) == [], "test config must be admitted by the space"
    src = instantiate(attention, cfg, shape)
    return cfg, shape, src, compile_source(src.code, src.entry, **kwargs)


@pytest.mark.parametrize("shape_text, overrides", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_compile_configs(attention, space, shape_text, overrides):
    """Each config compiles to an sm_90a ELF cubin with a plausible ptxas report that fits one SM."""
    cfg, shape, src, compiled = build(attention, space, shape_text, overrides)
    res = compiled.resources
    assert compiled.entry == "evotune_attention" and compiled.arch == DEFAULT_ARCH
    assert f"--gpu-architecture={DEFAULT_ARCH}" in compiled.options and "--ptxas-options=-v" in compiled.options
    assert 32 <= res.registers <= 255
    assert res.barriers >= 1
    if cfg["producer_warps"]:
        # Named barriers 0 .. 2*stages are in use (CTA barrier, FULL[s], EMPTY[s]).
        assert res.barriers >= 1 + 2 * cfg["stages"]
    assert res.static_smem == 0  # all tiles live in dynamic shared memory
    cubin = Path(compiled.cubin_path)
    assert cubin.is_file() and cubin.read_bytes()[:4] == ELF_MAGIC
    assert f"Compiling entry function 'evotune_attention' for '{DEFAULT_ARCH}'" in compiled.log
    geo = attention.geometry(cfg, shape)
    assert res.registers * geo.threads <= REGISTERS_PER_SM
    assert geo.dynamic_smem + res.static_smem <= SMEM_LIMIT_BYTES


def test_default_config_is_clean(attention, space, mission):
    """The default mission kernel uses no stack frame, spills nothing and passes the static checks."""
    cfg, shape, _, compiled = build(attention, space, "mission", {})
    res = compiled.resources
    assert res.stack_frame == 0 and res.spill_stores == 0 and res.spill_loads == 0
    geo = attention.geometry(cfg, shape)
    assert static_violations(res, geo.threads, geo.dynamic_smem) == []


def test_spilling_config_is_flagged(attention, space):
    """A config the space admits but ptxas must spill is caught by static_violations before any launch."""
    cfg, shape, _, compiled = build(attention, space, *SPILLING)
    res = compiled.resources
    assert res.spill_stores > 0 and res.spill_loads > 0 and res.stack_frame > 0
    geo = attention.geometry(cfg, shape)
    why = static_violations(res, geo.threads, geo.dynamic_smem)
    assert any(w.startswith("spills registers") for w in why)
    assert any(w.startswith("uses local memory") for w in why)


def test_second_compile_is_cached(attention, space, mission, tmp_path, monkeypatch):
    """Compiling the same source twice reads the cubin and its report back from the cache: NVRTC runs once."""
    monkeypatch.setenv("EVOTUNE_CACHE", str(tmp_path))  # an empty cache, so the first compile is real
    src = instantiate(attention, space.default_config(), mission)
    nvrtc_calls = []
    real_nvrtc = compile_module._nvrtc_compile

    def counted_nvrtc(*args, **kwargs):
        nvrtc_calls.append(args[1])
        return real_nvrtc(*args, **kwargs)

    monkeypatch.setattr(compile_module, "_nvrtc_compile", counted_nvrtc)
    first = compile_source(src.code, src.entry)
    assert not first.cached and first.compile_seconds > 0 and len(nvrtc_calls) >= 1
    compiles = len(nvrtc_calls)
    second = compile_source(src.code, src.entry)
    assert second.cached
    assert len(nvrtc_calls) == compiles  # read back, not compiled again
    assert second == first  # same key, entry, arch, path, options, log, resources, seconds (cached is not compared)
    assert Path(second.cubin_path).parent == tmp_path / "cubin"
    assert sorted(p.name for p in (tmp_path / "cubin").iterdir()) == [f"{first.key}.cubin", f"{first.key}.json"]


def test_cache_key_ignores_include_dirs_but_not_arch(attention, space, mission):
    """An extra -I path leaves the cache key alone; another architecture gives another key and another cubin."""
    src = instantiate(attention, space.default_config(), mission)
    base = compile_source(src.code, src.entry)
    with_include = compile_source(src.code, src.entry, extra_options=("-I/nonexistent/include",))
    assert with_include.key == base.key and with_include.cached
    assert "-I/nonexistent/include" in with_include.options
    sm80 = compile_source(src.code, src.entry, arch="sm_80")
    assert sm80.key != base.key and sm80.arch == "sm_80"
    assert sm80.cubin_path != base.cubin_path
    assert Path(sm80.cubin_path).read_bytes()[:4] == ELF_MAGIC
    assert Path(sm80.cubin_path).read_bytes() != Path(base.cubin_path).read_bytes()
    assert "for 'sm_80'" in sm80.log


def test_cache_key_changes_with_code_and_options(attention, space, mission):
    """Another config, or a semantic NVRTC option, gives a different cache key."""
    default = instantiate(attention, space.default_config(), mission)
    other = instantiate(attention, space.config({"stages": 3}), mission)
    a = compile_source(default.code, default.entry)
    b = compile_source(other.code, other.entry)
    c = compile_source(default.code, default.entry, extra_options=("-DEVOTUNE_TEST_DEFINE=1",))
    assert len({a.key, b.key, c.key}) == 3


SYNTHETIC_LOG = """\
ptxas info    : 92 bytes gmem
ptxas info    : Compiling entry function 'helper_kernel' for 'sm_90a'
ptxas info    : Function properties for helper_kernel
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers
ptxas info    : Compiling entry function 'evotune_attention' for 'sm_90a'
ptxas info    : Function properties for evotune_attention
ptxas         .     16 bytes stack frame, 24 bytes spill stores, 32 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1024 bytes smem
ptxas info    : Compile time = 235.333 ms
"""


def test_parse_resources_synthetic_log():
    """parse_resources reads the block of the named entry, not the one before it."""
    res = parse_resources(SYNTHETIC_LOG, "evotune_attention")
    assert res == Resources(registers=168, static_smem=1024, stack_frame=16, spill_stores=24, spill_loads=32,
                            barriers=16)
    helper = parse_resources(SYNTHETIC_LOG, "helper_kernel")
    assert helper == Resources(registers=40, static_smem=0, stack_frame=8, spill_stores=4, spill_loads=4, barriers=0)
    assert res.as_dict()["registers"] == 168


def test_parse_resources_missing_entry():
    """A log without a report for the entry raises CompileError carrying the log."""
    with pytest.raises(CompileError, match="no ptxas resource report for entry 'absent'") as info:
        parse_resources(SYNTHETIC_LOG, "absent")
    assert info.value.log == SYNTHETIC_LOG
    with pytest.raises(CompileError):
        parse_resources("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n", "k")


def test_syntax_error_raises_compile_error(tmp_path, monkeypatch):
    """A source NVRTC rejects raises CompileError: the message is the first error line, .log the whole log."""
    monkeypatch.setenv("EVOTUNE_CACHE", str(tmp_path))
    code = 'extern "C" __global__ void broken(int* x) {\n    int y = ;\n    x[0] = undeclared_name;\n}\n'
    with pytest.raises(CompileError) as info:
        compile_source(code, "broken", name="broken.cu")
    message, log = str(info.value), info.value.log
    assert message.startswith("NVRTC: ") and "\n" not in message
    assert re.search(r"broken\.cu\(2\): error", message)
    assert "broken.cu(2): error" in log and "broken.cu(3): error" in log and "undeclared_name" in log
    assert not any((tmp_path / "cubin").iterdir())  # nothing cached for a failed compile


def _res(**overrides) -> Resources:
    base = dict(registers=128, static_smem=0, stack_frame=0, spill_stores=0, spill_loads=0, barriers=1)
    return Resources(**{**base, **overrides})


def test_static_violations_clean_and_at_the_limits():
    """A kernel without spills, exactly at the register file and shared-memory limits, passes."""
    assert static_violations(_res(), 128, 40960) == []
    assert static_violations(_res(registers=255), 256, 0) == []  # 65280 of 65536
    assert static_violations(_res(registers=128, static_smem=1024), 512, SMEM_LIMIT_BYTES - 1024) == []


@pytest.mark.parametrize(
    "res, threads, smem, expected",
    [
        (_res(spill_stores=8), 128, 0, ["spills registers (8 B stores, 0 B loads)"]),
        (_res(spill_loads=4), 128, 0, ["spills registers (0 B stores, 4 B loads)"]),
        (_res(stack_frame=16), 128, 0, ["uses local memory (16 B stack frame)"]),
        (_res(registers=255), 512, 0, ["255 registers x 512 threads do not fit one SM's register file"]),
        (_res(), 128, SMEM_LIMIT_BYTES + 1, [f"shared memory {SMEM_LIMIT_BYTES + 1} B exceeds {SMEM_LIMIT_BYTES} B"]),
        (_res(static_smem=16), 128, SMEM_LIMIT_BYTES, [f"shared memory {SMEM_LIMIT_BYTES + 16} B exceeds {SMEM_LIMIT_BYTES} B"]),
    ],
    ids=["spill-stores", "spill-loads", "stack-frame", "register-file", "dynamic-smem", "static-plus-dynamic-smem"],
)
def test_static_violations_each_reason(res, threads, smem, expected):
    """Each reason a kernel must not run is reported on its own line."""
    assert static_violations(res, threads, smem) == expected


def test_static_violations_all_reasons():
    """A kernel failing every check gets all four reasons, in order."""
    res = _res(registers=200, stack_frame=64, spill_stores=32, spill_loads=32, static_smem=4096)
    why = static_violations(res, 1024, SMEM_LIMIT_BYTES)
    assert [w.split()[0] for w in why] == ["spills", "uses", "200", "shared"]


# Every (head dim x dtype x mask) variant of several configs compiles without spills or
# local memory: the kernel's variants are separate code paths, each must build cleanly.
MATRIX_CONFIGS = [
    dict(block_m=64, block_n=64, compute_warps=4, producer_warps=0, stages=2, smem_layout="swizzle", q_in_regs=False),
    dict(block_m=32, block_n=32, compute_warps=2, producer_warps=1, stages=3, smem_layout="pad", q_in_regs=True),
    dict(block_m=32, block_n=32, compute_warps=2, producer_warps=0, stages=2, smem_layout="plain", q_in_regs=False,
         kv_splits=4),
    dict(block_m=16, block_n=64, compute_warps=4, producer_warps=0, stages=2, smem_layout="swizzle", q_in_regs=True,
         warp_key_groups=4),
]


@pytest.mark.parametrize("cfg", MATRIX_CONFIGS, ids=["M64N64", "M32N32pw1", "M32N32kv4", "M16N64kg4"])
@pytest.mark.parametrize("variant", [f"{d}:{t}{c}" for d in (64, 128) for t in ("fp16", "bf16") for c in ("", ":causal")])
def test_every_variant_compiles_clean(attention, space, cfg, variant):
    """Each head-dim/dtype/mask variant of the config compiles for sm_90a with no spills and no stack frame."""
    head_dim, flags = variant.split(":", 1)
    shape = parse_shape(f"1,2,300,{head_dim}:{flags}")
    config = space.config(cfg)
    assert space.admitted(config, attention.context(shape)), space.violations(config, attention.context(shape))
    src = instantiate(attention, config, shape)
    res = compile_source(src.code, src.entry).resources
    assert res.spill_stores == res.spill_loads == res.stack_frame == 0, res
    assert 32 <= res.registers <= 255
    geo = attention.geometry(config, shape)
    assert static_violations(res, geo.threads, geo.dynamic_smem) == []


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _drop_checksum(meta_path: Path) -> None:
    import json

    meta = json.loads(meta_path.read_text())
    del meta["cubin_sha256"]
    meta_path.write_text(json.dumps(meta))


# How a cache entry gets damaged: a copy or a write cut short, an emptied file, an edit.
CACHE_DAMAGE = {
    "cubin-cut-short": lambda cubin, meta: _truncate(cubin),
    "cubin-empty": lambda cubin, meta: cubin.write_bytes(b""),
    "cubin-one-byte-changed": lambda cubin, meta: cubin.write_bytes(cubin.read_bytes()[:-1] + b"\x01"),
    "meta-cut-short": lambda cubin, meta: _truncate(meta),
    "meta-not-an-object": lambda cubin, meta: meta.write_text("[1, 2]"),
    "meta-without-resources": lambda cubin, meta: meta.write_text('{"log": "", "compile_seconds": 1.0}'),
    "old-entry-cubin-cut-short": lambda cubin, meta: (_drop_checksum(meta), _truncate(cubin)),
}


def test_damaged_cache_entry_is_recompiled(attention, space, mission, tmp_path, monkeypatch):
    """A damaged cache entry is detected, compiled afresh and replaced (never a crash, never a bad cubin); a whole
    entry written before entries carried a checksum is still used."""
    monkeypatch.setenv("EVOTUNE_CACHE", str(tmp_path))
    src = instantiate(attention, space.default_config(), mission)
    first = compile_source(src.code, src.entry)
    cubin, meta = Path(first.cubin_path), tmp_path / "cubin" / f"{first.key}.json"
    whole = cubin.read_bytes()
    for name, damage in CACHE_DAMAGE.items():
        damage(cubin, meta)
        again = compile_source(src.code, src.entry)
        assert not again.cached, name
        assert again.resources == first.resources and cubin.read_bytes() == whole, name
        assert compile_source(src.code, src.entry).cached, name  # the replacement is sound
    _drop_checksum(meta)
    assert compile_source(src.code, src.entry).cached
