"""The Hopper kernel's index arithmetic made lean (knob lean_addressing, the traits' LEAN_ADDRESSING: kLeanAddressing and
SlotUse, profile attention:hopper3-lean).

As written, each k-step's shared-memory matrix descriptor is rebuilt from its address (mask, shift, or) and the K/V
slot and parity come from signed % and /; lean, each descriptor is one add from the tile's address >> 4 and the slot
arithmetic is unsigned. The descriptors and slots are the same numbers.

CPU: every lean_addressing = false config keeps its source (attention-hopper3-overlap's, whose own test ties it to
attention-hopper3-rescale's and so to the recorded runs); the knob is a traits template parameter whose `if constexpr`
branches make every descriptor with smem_desc16, and no flag is left; in the SASS the instructions between a product's wgmma issues drop by a fifth
or more; the lean paths compile clean; the kernel's own issue_qk and issue_pv, compiled on the host with stubs for
wgmma, hand wgmma the same descriptors lean and written over every tile base of the shared window. GPU (marked): the
gate passes and the output is bit for bit the false twin's, the log-sum-exp too; memcheck and racecheck find
nothing."""

from __future__ import annotations

import re

import pytest
from _variant_pairs import (COMPILE_SHAPES, HOPPER_SHAPES, assert_compiles_clean, assert_gate_and_twin, assert_lse_twin,
                            assert_same_sources, assert_sanitizer_clean, compile_config, hopper_config_id,
                            serialised_notes, skip_unless_admitted)

from evotune.build.template import instantiate, template_flag_names
from evotune.problems.attention import is_lean_addressing
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_H = dict(mma="wgmma", lean_addressing=True)
# The current winners of gpt2 (two consumers, no producer, Q in registers, 64-key tiles) and llama-4k (persistent, two
# consumers with a producer), a three-consumer tile with Q in shared memory (the wgmma_ss descriptor path) and three
# stages (slot arithmetic by a non-power of two), and a ping-pong pair without the rotated loop.
LEAN_CONFIGS = [
    dict(_H, block_m=128, block_n=64, compute_warps=8, producer_warps=0, stages=4, q_in_regs=True, pingpong=False,
         persistent=False, epilogue="tma", rescale="lazy", softmax_overlap=True),
    dict(_H, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=True, pingpong=False,
         persistent=True, epilogue="tma", rescale="lazy", softmax_overlap=True),
    dict(_H, block_m=192, block_n=128, compute_warps=12, producer_warps=4, stages=3, q_in_regs=False,
         pingpong=False, persistent=True, epilogue="regs", rescale="new_max", softmax_overlap=True),
    dict(_H, block_m=128, block_n=64, compute_warps=8, producer_warps=4, stages=3, q_in_regs=False, pingpong=True,
         persistent=False, epilogue="regs"),
]


def _written(cfg: dict) -> dict:
    """The twin with the index arithmetic as written before the knob."""
    return dict(cfg, lean_addressing=False)


@pytest.fixture(scope="module")
def lean_space():
    return load_builtin("attention-hopper3-lean")


def test_every_written_config_keeps_its_source(attention, lean_space):
    """Each lean_addressing = false config of attention-hopper3-lean.yaml on gpt2 instantiates to the source of the
    same config in attention-hopper3-overlap.yaml; the space admits twice that space's 3840 configs there."""
    overlap_space = load_builtin("attention-hopper3-overlap")
    shape = parse_shape("gpt2")
    admitted = lean_space.admitted_configs(attention.context(shape))
    written = [c for c in admitted if not c["lean_addressing"]]
    assert len(written) == 3840 and len(admitted) == 7680
    assert_same_sources(attention, written, overlap_space, shape, drop="lean_addressing")


def test_tiles_space_is_the_lean_space_pinned(attention, lean_space):
    """attention-hopper3-tiles.yaml (the exhaustive searches' space) admits 640 configs on gpt2, each with rescale lazy,
    the rotated loop and lean addressing, and each instantiates to the source of the same config in
    attention-hopper3-lean.yaml."""
    tiles = load_builtin("attention-hopper3-tiles")
    shape = parse_shape("gpt2")
    admitted = tiles.admitted_configs(attention.context(shape))
    assert len(admitted) == 640
    assert all((c["rescale"], c["softmax_overlap"], c["lean_addressing"]) == ("lazy", True, True) for c in admitted)
    assert_same_sources(attention, admitted, lean_space, shape)


def test_lean_source(attention, lean_space):
    """The knob is the traits' template parameter LEAN_ADDRESSING (kLeanAddressing): smem_desc16 is defined once and
    every descriptor of issue_qk and issue_pv (and issue_pv_smem) has an `if constexpr` branch making it with
    smem_desc16; the slot sequence number is the traits' SlotUse (unsigned when lean); no flag is left; the false twin
    passes false. On mma.sync the knob selects nothing."""
    shape = parse_shape("gpt2")
    for cfg in (LEAN_CONFIGS[0], LEAN_CONFIGS[2]):  # Q from registers (wgmma_rs) and from shared memory (wgmma_ss)
        code = instantiate(attention, lean_space.config(cfg), shape).code
        assert "/* LEAN_ADDRESSING = */ true," in code
        assert code.count("u64 smem_desc16(u32 addr16, u32 lbo, u32 sbo)") == 1
        assert "using SlotUse = typename PickType<kLeanAddressing, unsigned, int>::type;" in code
        assert code.count("if constexpr (T::kLeanAddressing)") >= 3
        assert "const typename T::SlotUse use = it0 + t;" in code
        assert template_flag_names(code) == set()
        plain = instantiate(attention, lean_space.config(_written(cfg)), shape).code
        assert "/* LEAN_ADDRESSING = */ false," in plain
    assert is_lean_addressing(lean_space.config(LEAN_CONFIGS[0]))
    assert not is_lean_addressing(dict(mma="sync", lean_addressing=True))


# Host harness for the kernel's own descriptor code: issue_qk and issue_pv (with smem_desc and smem_desc16; LEAN sets
# the traits' kLeanAddressing) cut from an instantiated source and compiled by the host's C++ compiler, the wgmma calls replaced by
# stubs that print each descriptor they are given.
_DESC_PRELUDE = """#include <cstdio>
#include <type_traits>
typedef unsigned int u32;
typedef unsigned long long u64;
#define __device__
#define __forceinline__ inline
template <int N, bool BF16> struct Wgmma {};
template <int TRANS_B, class W, class D, class A>
void wgmma_rs(W, D&, const A&, u64 desc_b, int) { std::printf("%s %llx\\n", TRANS_B ? "V" : "K", desc_b); }
template <int TRANS_B, class W, class D>
void wgmma_ss(W, D&, u64 desc_a, u64 desc_b, int) { std::printf("Q %llx\\nK %llx\\n", desc_a, desc_b); }
inline void wgmma_commit() {}
"""
_DESC_MAIN = """
template <int BLOCK_M, int BLOCK_N, int HEAD_DIM, bool Q_IN_REGS>
struct Traits {
    static constexpr int kBlockM = BLOCK_M, kBlockN = BLOCK_N, kHeadDim = HEAD_DIM, kTileDim = HEAD_DIM, kTileDimV = HEAD_DIM;
    static constexpr bool kQInRegs = Q_IN_REGS, kIsBf16 = false, kLeanAddressing = LEAN;
    static constexpr int kQKSteps = kHeadDim / 16, kQRegSteps = kQInRegs ? kQKSteps : 1, kPVSteps = kBlockN / 16;
    static constexpr int kSAcc = kBlockN / 2, kOAcc = kHeadDim / 2;
};
template <class T>
void sweep() {
    static float s[T::kSAcc], o[T::kOAcc];
    static u32 qr[T::kQRegSteps][4], p[T::kPVSteps][4];
    // Every 1024-byte-aligned tile base (TMA's 128-byte swizzle) whose operand ends inside the 228 KB window.
    const u32 window = 228 * 1024, regions = T::kHeadDim / 64;
    const u32 k_bytes = regions * T::kBlockN * 128, q_bytes = regions * T::kBlockM * 128;
    for (u32 base = 0; base + k_bytes <= window; base += 1024) {
        issue_qk<T>(s, qr, base + q_bytes <= window ? base : 0, base);  // Q's tile at the same base (or 0)
        issue_pv<T>(o, p, base);
    }
}
int main() {
    sweep<Traits<128, 64, 64, true>>();
    sweep<Traits<128, 64, 64, false>>();
    sweep<Traits<192, 128, 64, false>>();
    sweep<Traits<128, 176, 128, true>>();
    sweep<Traits<64, 32, 128, false>>();
    return 0;
}
"""


def _run_host_harness(source: str, folder, name: str) -> list[str]:
    """Compile `source` with the host's C++ compiler in `folder` (pytest.skip without one), run it and return its
    output lines."""
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    (folder / f"{name}.cpp").write_text(source)
    subprocess.run([cxx, "-std=c++17", "-O1", f"{name}.cpp", "-o", name], cwd=folder, check=True)
    return subprocess.run([str(folder / name)], capture_output=True, text=True, check=True).stdout.splitlines()


def _descriptor_trace(code: str, folder, lean: bool) -> list[str]:
    """The descriptors the source's issue_qk and issue_pv hand to wgmma over the harness's sweep, one line each, with
    the traits' kLeanAddressing at `lean`."""
    parts = []
    for name in ("u64 smem_desc(", "u64 smem_desc16(", "void issue_qk(", "void issue_pv("):
        found = re.search(r"(template <class T>\n)?__device__ __forceinline__ " + re.escape(name) + r".*?\n}\n", code,
                          re.S)
        assert found, name
        parts.append(found.group(0))
    text = "\n".join(parts)
    asm = 'asm("mov.b64 %0, {%1, %2};" : "=l"(desc) : "r"(lo), "r"(hi));'
    assert asm in text
    text = text.replace(asm, "desc = (static_cast<u64>(hi) << 32) | lo;")
    define = f"#define LEAN {'true' if lean else 'false'}\n"
    return _run_host_harness(define + _DESC_PRELUDE + text + _DESC_MAIN, folder, "desc")


def test_lean_descriptors_are_the_written_ones(attention, lean_space, tmp_path):
    """The kernel's own descriptor code, compiled on the host: over every 1024-byte-aligned tile base of the 228 KB
    shared window and five tiles (Q from registers and from shared memory, 32 to 176 keys, d64 and d128), the lean
    issue_qk and issue_pv hand wgmma exactly the descriptors the written ones do, in the same order."""
    shape = parse_shape("gpt2")
    traces = {}
    for lean in (True, False):
        code = instantiate(attention, lean_space.config(dict(LEAN_CONFIGS[0], lean_addressing=lean)), shape).code
        (tmp_path / str(lean)).mkdir()
        traces[lean] = _descriptor_trace(code, tmp_path / str(lean), lean)
    assert len(traces[False]) > 10000 and len({line.split()[0] for line in traces[False]}) == 3
    assert traces[True] == traces[False]


@pytest.mark.parametrize("cfg", LEAN_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", ["gpt2", "llama-4k:bf16:causal"])
def test_sass_issues_fewer_instructions_between_wgmma(attention, lean_space, cfg, shape_text):
    """The measurable claim of the knob, read in the SASS: between the HGMMA of one product ptxas places at least a
    fifth fewer instructions (the gpt2 winner: 91 to 56; llama-4k's: 146 to 61), and never more in the widest gap;
    the number of products and HGMMA is the same."""
    from evotune.build.sass import disassemble, opcode_counts, wgmma_issue_gaps

    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, lean_space, shape, cfg, _written(cfg))
    gaps, hgmma = {}, {}
    for c in (cfg, _written(cfg)):
        sass = disassemble(compile_config(attention, lean_space, shape, c)[2].cubin_path)
        gaps[c["lean_addressing"]] = wgmma_issue_gaps(sass)
        hgmma[c["lean_addressing"]] = opcode_counts(sass)["HGMMA"]
    assert hgmma[True] == hgmma[False] and len(gaps[True]) == len(gaps[False]) > 0, (hgmma, gaps)
    assert sum(gaps[True]) <= 4 * sum(gaps[False]) // 5, gaps
    assert max(gaps[True]) <= max(gaps[False]), gaps


@pytest.mark.parametrize("cfg", LEAN_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", COMPILE_SHAPES)
def test_lean_configs_compile_clean(attention, lean_space, cfg, shape_text):
    """Every lean path compiles for sm_90a with no stack frame, no spill, within the static gate, and without ptxas
    serialising the wgmma."""
    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, lean_space, shape, cfg, _written(cfg))
    _, compiled, _ = assert_compiles_clean(attention, lean_space, shape, cfg)
    assert not serialised_notes(compiled)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", LEAN_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", HOPPER_SHAPES)
def test_lean_passes_the_gate_bit_for_bit(attention, lean_space, cfg, shape_text):
    """The full gate passes, and the output is bit for bit the false twin's: the same descriptors and slots."""
    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, lean_space, shape, cfg, _written(cfg))
    assert_gate_and_twin(attention, lean_space, shape, cfg, _written(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [LEAN_CONFIGS[0], LEAN_CONFIGS[2]], ids=hopper_config_id)
def test_lean_with_log_sum_exp(attention, lean_space, cfg):
    """The training variant (write_lse): O and the log-sum-exp bit for bit the false twin's."""
    shape = parse_shape("4,16,1333,1257,64:bf16:causal")  # 448 query tiles of 192 rows: the persistent grid too
    assert lean_space.admitted(lean_space.config(cfg), attention.context(shape))
    assert_lse_twin(attention, lean_space, shape, cfg, _written(cfg))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("cfg", [LEAN_CONFIGS[0], LEAN_CONFIGS[1]], ids=hopper_config_id)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizers_clean(attention, lean_space, cfg, tool):
    """memcheck and racecheck find nothing on a ragged causal shape: the two-consumer config whose consumer thread
    refills the slots, and a persistent one with a producer warpgroup."""
    assert_sanitizer_clean(attention, lean_space, parse_shape("2,3,197,300,64:causal"), cfg, tool)


# Host harness for the kernel's own refill (the loader's slot and parity arithmetic, signed as written, unsigned lean):
# cut from an instantiated source and compiled by the host's C++ compiler, the barrier waits and TMA loads replaced by
# stubs that print the barrier, slot, parity and tile they are given.
_REFILL_PRELUDE = """#include <cstdio>
#include <type_traits>
typedef unsigned int u32;
#define __device__
#define __forceinline__ inline
struct CUtensorMap {};
template <class T>
struct Barriers {
    unsigned long long k_empty[4], v_empty[4];
};
static Barriers<void> g_bars;
inline u32 smem_addr(const unsigned long long* bar) { return static_cast<u32>(bar - g_bars.k_empty); }
inline void mbar_wait(u32 bar, u32 parity) { std::printf("W %u %u\\n", bar, parity); }
template <class T, int WHICH>
void load_kv(const CUtensorMap*, u32, Barriers<T>*, int slot, int t, int, int, int = 0) {  // kv_row0: VARLEN only
    std::printf("L%d %d %d\\n", WHICH, slot, t);
}
"""
_REFILL_MAIN = """
template <int STAGES>
struct Traits {
    static constexpr int kStages = STAGES;
    static constexpr bool kLocal = false;  // no sliding window: the refill's tile is t + STAGES, as before kLocal
    using SlotUse = std::conditional_t<LEAN, unsigned, int>;
};
template <class T>
void sweep() {
    static CUtensorMap map;
    for (int t = 0; t < 20000; ++t) refill<T>(&map, &map, 0, 0, reinterpret_cast<Barriers<T>*>(&g_bars), t, 0, 0);
}
int main() {
    sweep<Traits<1>>();
    sweep<Traits<2>>();
    sweep<Traits<3>>();
    sweep<Traits<4>>();
    return 0;
}
"""


def _refill_trace(code: str, folder, lean: bool) -> list[str]:
    """The barrier waits and loads the source's refill makes over the harness's sweep (tiles 0 to 19999 at 1 to 4
    stages), one line each."""
    found = re.search(r"template <class T>\n__device__ __forceinline__ void refill\(.*?\n}\n", code, re.S)
    assert found
    define = f"#define LEAN {'true' if lean else 'false'}\n"
    return _run_host_harness(define + _REFILL_PRELUDE + found.group(0) + _REFILL_MAIN, folder, "refill")


def test_lean_refill_is_the_written_one(attention, lean_space, tmp_path):
    """The kernel's own refill (the loader thread's, without a producer warpgroup), compiled on the host: over tiles 0
    to 19999 at one to four stages, the unsigned slot and parity wait on the same barriers with the same parities and
    load the same tiles into the same slots as the signed ones; and those are tile t's slot t % STAGES, parity
    (t / STAGES) & 1."""
    shape = parse_shape("gpt2")
    traces = {}
    for lean in (True, False):
        code = instantiate(attention, lean_space.config(dict(LEAN_CONFIGS[0], lean_addressing=lean)), shape).code
        assert "static_cast<typename T::SlotUse>(t) % T::kStages" in code
        (tmp_path / str(lean)).mkdir()
        traces[lean] = _refill_trace(code, tmp_path / str(lean), lean)
    assert traces[True] == traces[False]
    lines = iter(traces[False])
    for stages in (1, 2, 3, 4):
        for t in range(20000):
            slot, parity = t % stages, (t // stages) & 1
            assert [next(lines) for _ in range(4)] == [f"W {slot} {parity}", f"L0 {slot} {t + stages}",
                                                       f"W {4 + slot} {parity}", f"L1 {slot} {t + stages}"]
