"""CPU tests of the Hopper variant's persistent grid (knob persistent): the tile order the kernel walks (its C++
compiled with the host compiler), the space's rules for the knob, the launch geometry and arguments, and real
NVRTC compiles of persistent kernels for sm_90a."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from evotune.build.compile import compile_source, static_violations
from evotune.build.sass import disassemble, summary
from evotune.build.template import instantiate
from evotune.problems.attention import MULTIPROCESSORS, query_tiles
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin
from _paths import REPO_ROOT
from _variant_pairs import serialised_notes

W = dict(mma="wgmma", smem_layout="swizzle")
PERSISTENT = dict(W, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=False,
                  persistent=True)
# A persistent config per consumer warpgroup count, Q from shared memory or registers, causal, bf16, d128, 176 keys.
SPREAD = [
    ("4,32,4096,128", PERSISTENT),
    ("4,32,4096,128:bf16:causal", dict(PERSISTENT, stages=3, q_in_regs=True)),
    ("4,32,4096,128", dict(PERSISTENT, block_n=176)),
    ("2,16,8192,64", dict(PERSISTENT, block_m=192, compute_warps=12)),
    ("16,12,1024,64:causal", dict(PERSISTENT, block_m=64, compute_warps=4, q_in_regs=True)),
]


# ---------------------------------------------------------------- the tile order, as the kernel computes it

_ORDER_MAIN = r"""
#include <cstdio>
#include <cstdlib>
template <bool CAUSAL, int BLOCK_M, int HEAD_DIM>
struct Traits {
    static constexpr bool kIsCausal = CAUSAL;
    static constexpr int kBlockM = BLOCK_M, kBlockN = 64, kHeadDim = HEAD_DIM, kHeadDimV = HEAD_DIM;
};
template <class T>
int run(int heads, int batch, int seq_q, int seq_k, int group) {
    const int m_blocks = (seq_q + T::kBlockM - 1) / T::kBlockM, head_batches = heads * batch;
    const int section = l2_section_pairs<T>(head_batches, seq_k, group);
    std::printf("section %d\n", section);
    for (int tile = 0; tile < m_blocks * head_batches; ++tile) {
        const QTile w = persistent_tile<T>(tile, m_blocks, heads, head_batches, section);
        std::printf("%d %d %d %d\n", w.row0, w.head, w.batch, kv_tile_count<T>(w.row0, seq_k));
    }
    return 0;
}
int main(int argc, char** argv) {
    const int causal = std::atoi(argv[1]), d = std::atoi(argv[2]), heads = std::atoi(argv[3]), batch = std::atoi(argv[4]);
    const int seq_q = std::atoi(argv[5]), seq_k = std::atoi(argv[6]), group = std::atoi(argv[7]);
    if (causal && d == 128) return run<Traits<true, 128, 128>>(heads, batch, seq_q, seq_k, group);
    if (causal) return run<Traits<true, 192, 64>>(heads, batch, seq_q, seq_k, group);
    if (d == 128) return run<Traits<false, 128, 128>>(heads, batch, seq_q, seq_k, group);
    return run<Traits<false, 192, 64>>(heads, batch, seq_q, seq_k, group);
}
"""


@pytest.fixture(scope="module")
def tile_order(tmp_path_factory):
    """Runs the kernel's own persistent_tile / kv_tile_count / l2_section_pairs (the marked stretch of
    kernels/hopper/scheduler.cuh, compiled by the host's C++ compiler): (causal, d, heads, batch, seq_q, seq_k)
    (, group) -> (section, [(row0, head, batch, kv tiles)] in tile order)."""
    cxx = shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    text = (REPO_ROOT / "kernels" / "hopper" / "scheduler.cuh").read_text()
    stretch = re.search(r"// ---- persistent tile order.*?// ---- end of the persistent tile order", text, re.S)
    assert stretch, "the marked persistent tile order is gone from kernels/hopper/scheduler.cuh"
    prelude = "#include <algorithm>\nusing std::max; using std::min;\n#define __device__\n#define __forceinline__ inline\n"
    folder = tmp_path_factory.mktemp("order")
    (folder / "order.cpp").write_text(prelude + stretch.group(0) + _ORDER_MAIN)
    subprocess.run([cxx, "-std=c++17", "-O1", "order.cpp", "-o", "order"], cwd=folder, check=True)

    def run(causal, d, heads, batch, seq_q, seq_k, group=1):
        out = subprocess.run([str(folder / "order"), *map(str, (int(causal), d, heads, batch, seq_q, seq_k, group))],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        return int(out[0].split()[1]), [tuple(map(int, line.split())) for line in out[1:]]

    return run


@pytest.mark.parametrize("causal, d, heads, batch, seq_q, seq_k", [
    (False, 64, 16, 2, 8192, 8192), (False, 128, 3, 2, 1000, 77), (True, 128, 32, 4, 4096, 4096),
    (True, 64, 5, 3, 1000, 1000), (True, 128, 7, 1, 300, 2000), (True, 64, 1, 1, 100, 100)])
def test_every_query_tile_exactly_once(tile_order, causal, d, heads, batch, seq_q, seq_k):
    """The persistent order is a permutation of the (query tile, head, batch) grid, ragged sequences included."""
    block_m = 128 if d == 128 else 192
    _, tiles = tile_order(causal, d, heads, batch, seq_q, seq_k)
    m_blocks = -(-seq_q // block_m)
    assert len(tiles) == m_blocks * heads * batch
    assert {t[:3] for t in tiles} == {(m * block_m, h, b) for m in range(m_blocks) for h in range(heads)
                                      for b in range(batch)}


def test_non_causal_order_keeps_a_heads_tiles_together(tile_order):
    """Non-causal: a (batch, head)'s query tiles are consecutive, so the tiles in flight share few heads' K/V."""
    _, tiles = tile_order(False, 64, 16, 2, 8192, 8192)
    m_blocks = -(-8192 // 192)
    for i in range(0, len(tiles), m_blocks):
        assert len({t[1:3] for t in tiles[i:i + m_blocks]}) == 1
        assert [t[0] for t in tiles[i:i + m_blocks]] == [m * 192 for m in range(m_blocks)]


def test_causal_order_is_longest_first_within_l2_sections(tile_order):
    """Causal: (batch, head) pairs come in sections whose K and V fit 32 MB (16 heads of 4096 x 128), and within
    each the tiles with the most K/V tiles come first; the last, partial section too."""
    section, tiles = tile_order(True, 128, 7, 4, 4096, 4096)  # 28 pairs: sections of 16 and 12
    assert section == 16
    m_blocks = 4096 // 128
    first, second = tiles[:16 * m_blocks], tiles[16 * m_blocks:]
    for part, width in ((first, 16), (second, 12)):
        kv = [t[3] for t in part]
        assert kv == sorted(kv, reverse=True) and kv[0] == 4096 // 64 and kv[-1] == 2
        assert len({(t[1], t[2]) for t in part[:width]}) == width  # the heads vary fastest
    assert len({(t[1], t[2]) for t in first}) == 16 and len({(t[1], t[2]) for t in second}) == 12


def test_grouped_heads_make_sections_that_many_times_wider(tile_order):
    """With grouped-query attention a section counts query heads, `group` of which share one K/V head: 4 heads per
    K/V head fit four times as many pairs in the same 32 MB (capped at all of them)."""
    assert tile_order(True, 128, 64, 2, 4096, 4096, 4)[0] == 64
    assert tile_order(True, 128, 8, 2, 4096, 4096, 8)[0] == 16


def test_short_keys_make_one_section(tile_order):
    """With few keys every pair's K/V fits together: one section, longest tiles first over all heads."""
    section, tiles = tile_order(True, 64, 5, 3, 1000, 1000)
    assert section == 15
    kv = [t[3] for t in tiles]
    assert kv == sorted(kv, reverse=True)


# ---------------------------------------------------------------- the space, geometry and arguments

def test_the_knob_is_admitted_only_where_a_cta_gets_several_tiles(attention, space):
    """persistent needs the Hopper variant with its producer warpgroup and no ping-pong, and more query tiles than
    SMs: the mission shape (64 tiles at most) admits none, so its admitted configs are the same as before."""
    llama = parse_shape("llama-4k")
    ctx = attention.context(llama)
    assert not space.violations(space.config(PERSISTENT), ctx)
    for bad in (dict(PERSISTENT, producer_warps=0), dict(PERSISTENT, pingpong=True),
                dict(block_m=128, block_n=64, compute_warps=8, producer_warps=1, stages=2, persistent=True)):
        assert space.violations(space.config(bad), ctx)
    # 128-row tiles on 8 heads: 2048 rows are 8 x 16 = 128 tiles (<= 132 SMs), 2049 are 8 x 17 = 136.
    assert space.violations(space.config(PERSISTENT), attention.context(parse_shape("1,8,2048,64")))
    assert not space.violations(space.config(PERSISTENT), attention.context(parse_shape("1,8,2049,64")))
    assert query_tiles(space.config(PERSISTENT), parse_shape("1,8,2048,64")) == 128
    hopper3 = load_builtin("attention-hopper3")
    mission_cfgs = hopper3.admitted_configs(attention.context(parse_shape("mission")))
    assert mission_cfgs and not any(c["persistent"] for c in mission_cfgs)


def test_the_oracle_spaces_do_not_carry_the_knob():
    """attention-hopper.yaml (the gpt2 oracle's 126 configs) and attention-small.yaml (the mission oracle's 972)
    omit it, so their configs, and the runs measured over them, stay as they were."""
    for name, size in (("attention-hopper", 384), ("attention-small", 972)):
        s = load_builtin(name)
        assert "persistent" not in {p.name for p in s.params} and s.size() == size
    assert "persistent" in {p.name for p in load_builtin("attention-hopper3").params}


def test_persistent_geometry_and_arguments(attention, space):
    """A persistent launch is min(query tiles, SMs) CTAs in x (the H100's 132 by default, the device's when the
    plan is made where CUDA is up), and every wgmma launch passes the query heads, the batch and the tile counters
    after kv_magic."""
    shape = parse_shape("4,32,4096,128")
    config = space.config(PERSISTENT)
    assert attention.geometry(config, shape).grid == (MULTIPROCESSORS, 1, 1) == (132, 1, 1)
    assert attention.geometry(config, shape, multiprocessors=114).grid == (114, 1, 1)
    small = parse_shape("1,2,300,64")
    assert attention.geometry(config, small).grid == (6, 1, 1)  # 3 tiles x 2 heads
    one_tile = space.config(dict(PERSISTENT, persistent=False))
    assert attention.geometry(one_tile, shape).grid == (32, 32, 4)
    names = [n for n, _ in attention.entry_params(config)]
    assert names[names.index("kv_magic"):] == ["kv_magic", "n_heads", "n_batch", "tile_counter"]
    assert names == [n for n, _ in attention.entry_params(one_tile)]
    src = instantiate(attention, config, shape)
    assert "unsigned kv_magic, int n_heads, int n_batch, unsigned* tile_counter)" in src.code and "/* PERSISTENT = */ true" in src.code
    assert "/* PERSISTENT = */ false" in instantiate(attention, one_tile, shape).code
    notes = "\n".join(attention.launch_notes(config, shape))
    assert "min(4096 query tiles, the device's SMs)" in notes and "tile_counter none" in notes


def test_only_the_causal_persistent_grid_takes_tile_counters(attention, space):
    """The causal persistent grid hands out tiles from two counters (a workspace of 2 ints, zeroed per launch the op
    makes, and by the kernel after each launch); the non-causal one and the one-tile grid take none."""
    import torch

    causal, plain = parse_shape("4,32,4096,128:causal"), parse_shape("4,32,4096,128")
    config, one_tile = space.config(PERSISTENT), space.config(dict(PERSISTENT, persistent=False))
    assert attention.workspace_elems(config, causal) == (0, 0, 2)
    assert attention.workspace_elems(config, plain) == attention.workspace_elems(one_tile, causal) == (0, 0, 0)
    assert attention.launch_plan(config, causal).workspace == (0, 0, 2)
    ws = attention.new_workspace(config, causal, "cpu")
    assert ws[2].dtype == torch.int32 and ws[2].tolist() == [0, 0]
    assert attention.new_workspace(config, plain, "cpu") == ()
    assert "tile_counter 2 uint32 zeroed once" in "\n".join(attention.launch_notes(config, causal))


def test_launch_plan_takes_the_devices_sm_count(attention, space, monkeypatch):
    """The plan's grid comes from the SM count where the kernel runs (a GPU with fewer SMs gets fewer CTAs);
    plans of one-tile configs do not ask."""
    import evotune.problems.attention as A

    shape = parse_shape("2,16,8192,64")
    monkeypatch.setattr(A, "current_multiprocessors", lambda: 78)
    assert attention.launch_plan(space.config(PERSISTENT), shape).grid == (78, 1, 1)
    monkeypatch.setattr(A, "current_multiprocessors", lambda: pytest.fail("asked for the SMs of a one-tile config"))
    assert attention.launch_plan(space.config(dict(PERSISTENT, persistent=False)), shape).grid == (64, 16, 2)


def test_sm_count_override(attention, space, monkeypatch):
    """EVOTUNE_SM_COUNT caps a persistent grid (the GPU tests use it to give each CTA several tiles); a bad value
    is a one-line usage error."""
    from evotune.errors import UsageError
    from evotune.problems.attention import current_multiprocessors

    monkeypatch.setenv("EVOTUNE_SM_COUNT", "3")
    assert current_multiprocessors() == 3
    assert attention.launch_plan(space.config(PERSISTENT), parse_shape("1,2,1000,64")).grid == (3, 1, 1)
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("EVOTUNE_SM_COUNT", bad)
        with pytest.raises(UsageError, match="EVOTUNE_SM_COUNT"):
            current_multiprocessors()


def test_no_torch_import_to_size_the_grid():
    """current_multiprocessors reads the device only through a torch already imported: the search process, which
    sizes no launch, never imports torch for it (it costs seconds; issue 14)."""
    import subprocess
    import sys

    code = ("import sys; from evotune.problems.attention import current_multiprocessors as c; "
            "n = c(); print(n, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["132", "False"]


# ---------------------------------------------------------------- compiled kernels

@pytest.mark.parametrize("shape_text,cfg", SPREAD, ids=[s for s, _ in SPREAD])
def test_persistent_kernels_compile_async_and_clean(attention, space, shape_text, cfg):
    """Each persistent path compiles for sm_90a without spills or local memory, ptxas keeps its wgmma
    asynchronous, and its code is not the one-tile kernel's (the knob changes the program)."""
    shape = parse_shape(shape_text)
    config = space.config(cfg)
    assert not space.violations(config, attention.context(shape))
    src = instantiate(attention, config, shape)
    compiled = compile_source(src.code, src.entry)
    geo = attention.geometry(config, shape)
    assert static_violations(compiled.resources, geo.threads, geo.dynamic_smem) == []
    assert not serialised_notes(compiled)
    sass = summary(disassemble(compiled.cubin_path))
    assert sass["tensor_core"] == "wgmma" and sass["local_memory"] == 0
    one_tile = instantiate(attention, space.config(dict(cfg, persistent=False)), shape)
    other = compile_source(one_tile.code, one_tile.entry)
    assert disassemble(other.cubin_path) != disassemble(compiled.cubin_path)
    # Causal tiles come from the global tile counter (atomics); non-causal ones from a fixed stride (none).
    atomics = [line for line in disassemble(compiled.cubin_path).splitlines() if "ATOMG" in line]
    assert bool(atomics) == shape.causal, atomics
