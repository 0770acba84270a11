"""Logit soft-capping and the sliding window (issue 42): shape spelling, the fp32 reference, the dependency mask, the
space's admission, the table key, and the Hopper kernel's SOFTCAP / LOCAL traits (CPU: NVRTC; GPU tests marked)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from evotune.errors import UsageError
from evotune.problems.attention import SCORE_MOD_PARAMS, score_mod_values, visibility_mask
from evotune.problems.shapes import Shape, parse_shape
from evotune.records.tuning_table import TableKey, window_bucket
from evotune.space.searchspace import load_builtin, shape_context


# ------------------------------------------------------------------ shapes


@pytest.mark.parametrize("text, softcap, window", [
    ("1,2,64,64:softcap=30.0", 30.0, (-1, -1)),
    ("1,2,64,96,64:bf16:window=16,0", 0.0, (16, 0)),
    ("1,2,64,64:causal:window=8,8:softcap=50", 50.0, (8, 8)),
    ("mission:window=-1,0", 0.0, (-1, 0)),
])
def test_flags_read_and_round_trip(text, softcap, window):
    """softcap=C and window=L,R set the shape's fields, and the spelling and the record read back to the same shape."""
    s = parse_shape(text)
    assert (s.softcap, (s.window_left, s.window_right)) == (softcap, window)
    assert parse_shape(s.spec) == s and Shape.from_dict(s.as_dict()) == s


def test_shapes_without_the_flags_spell_as_before():
    """A dense shape's spelling and record name neither field (older specs and records read the same)."""
    s = parse_shape("gpt2:bf16:kv4")
    assert "softcap" not in s.spec and "window" not in s.spec
    assert "softcap" not in s.as_dict() and "window" not in s.as_dict()


@pytest.mark.parametrize("text, fragment", [
    ("1,2,64,64:softcap=0", "finite C > 0"),
    ("1,2,64,64:softcap=inf", "finite C > 0"),
    ("1,2,64,64:softcap=abc", "finite C > 0"),
    ("1,2,64,64:window=4", "window=L,R"),
    ("1,2,64,64:window=-2,0", "window=L,R"),
    ("1,2,64,64:window=1,2:window=3,4", "conflicts with"),
    ("1,2,64,128,64:causal:window=8,0", "needs Sq == Sk"),
])
def test_bad_flags_are_usage_errors(text, fragment):
    """A malformed or contradictory flag is a UsageError naming what to write."""
    with pytest.raises(UsageError) as info:
        parse_shape(text)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_bad_flag_from_the_cli_exits_2(main_in_process):
    """From the CLI, a bad window is one error line and exit code 2, before any hardware."""
    proc = main_in_process("check", "--shape", "1,2,64,64:window=x,0")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "window=L,R" in lines[0] and "Traceback" not in proc.stderr


def test_flops_count_the_visible_pairs():
    """A window's FLOPs are 4·D per visible (query, key) pair, counted here by brute force."""
    s = parse_shape("1,1,37,53,64:window=5,3")
    pairs = sum(1 for i in range(37) for j in range(53) if i + 16 - 5 <= j <= i + 16 + 3)
    assert s.visible_pairs() == pairs and s.flops() == 4.0 * 64 * pairs


# ------------------------------------------------------------------ the reference and the dependency mask


def _brute_force(shape: Shape, q, k, v, scale):
    """softmax over each row's visible keys, element by element in float64 (numpy), rows with none 0."""
    b_, h_, sq, d = q.shape
    out = np.zeros((b_, h_, sq, d))
    diag = shape.seq_k - shape.seq_q
    for b in range(b_):
        for h in range(h_):
            kh = h // shape.kv_group
            for i in range(sq):
                keys = [j for j in range(shape.seq_k)
                        if (not shape.causal or j <= i)
                        and (shape.window_left < 0 or j >= i + diag - shape.window_left)
                        and (shape.window_right < 0 or j <= i + diag + shape.window_right)]
                if not keys:
                    continue
                s = np.array([float(np.dot(q[b, h, i], k[b, kh, j])) * scale for j in keys])
                if shape.has_softcap:
                    s = shape.softcap * np.tanh(s / shape.softcap)
                p = np.exp(s - s.max())
                out[b, h, i] = (p / p.sum()) @ v[b, kh, keys]
    return out


@pytest.mark.parametrize("text", [
    "1,2,9,13,64:window=2,1",          # bottom-right: row i's diagonal is key i + 4
    "1,2,13,9,64:window=0,0",          # Sq > Sk: the first rows see no key (0)
    "1,4,11,64:causal:window=3,5:kv2",  # causal cuts the right side; grouped K/V heads
    "1,2,10,12,64:softcap=2.5",        # a small cap, so tanh bends the scores
    "1,2,10,64:bf16:softcap=30:window=-1,0",
])
def test_reference_matches_a_per_element_computation(attention, text):
    """The fp32 reference equals a straightforward float64 loop over each row's visible keys (window edges, bottom-right
    alignment, rows with no key, softcap)."""
    shape = parse_shape(text)
    inputs = attention.make_inputs(shape, seed=3, device="cpu")
    q, k, v = (inputs[n].float().numpy().astype(np.float64) for n in ("q", "k", "v"))
    want = _brute_force(shape, q, k, v, inputs["scale"])
    got = attention.reference(shape, inputs).numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("text", ["1,2,24,40,64:window=4,2:kv1", "1,2,30,20,64:window=3,0", "1,2,24,64:causal:window=5,0"])
def test_dependency_mask_is_the_rows_that_see_the_key(attention, text):
    """perturb's must-change rows are exactly those whose reference output changes when the key changes."""
    import torch

    shape = parse_shape(text)
    inputs = attention.make_inputs(shape, seed=1, device="cpu")
    before = attention.reference(shape, inputs)
    rng = random.Random(7)
    for _ in range(4):
        changed, must_change = attention.perturb(shape, inputs, rng)
        moved = (attention.reference(shape, changed) != before).any(dim=-1)
        assert must_change.any() and torch.equal(moved, must_change)


def test_visibility_mask_is_flash_attentions_window():
    """Row i sees key j iff i + Sk - Sq - L <= j <= i + Sk - Sq + R (window=L,0 with Sq = Sk: causal, band L)."""
    m = visibility_mask(parse_shape("1,1,6,64:window=2,0"))
    assert m.sum(dim=1).tolist() == [1, 2, 3, 3, 3, 3] and not m.triu(1).any()
    m = visibility_mask(parse_shape("1,1,2,5,64:window=0,0"))
    assert m.nonzero().tolist() == [[0, 3], [1, 4]]


def test_runtime_values_fold_the_cap_and_bound_the_window():
    """The entry gets scale / C, and each window side clamped (an unbounded side at the sequence's length)."""
    s = parse_shape("1,1,100,300,64:softcap=30:window=-1,5000")
    assert score_mod_values(s, 0.125) == {"softcap_scale": 0.125 / 30, "window_left": 300, "window_right": 100}


# ------------------------------------------------------------------ the space and the table key


def test_space_admits_the_new_shapes_on_wgmma_only(space):
    """mma.sync configs are refused on softcap and window shapes, Hopper ones admitted; causal_extent = warpgroup is
    refused with a window."""
    for text in ("gpt2:softcap=30", "gpt2:window=256,0"):
        ctx = shape_context(parse_shape(text))
        sync = space.config({"mma": "sync"})
        assert any("Hopper kernel's" in v for v in space.violations(sync, ctx))
        hopper = space.config({"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4,
                               "block_n": 128, "q_in_regs": False})
        assert space.violations(hopper, ctx) == []
    causal = load_builtin("attention-hopper3-causal")

    def extents(text):
        return {c.as_dict().get("causal_extent") for c in causal.admitted_configs(shape_context(parse_shape(text)))}

    assert "warpgroup" in extents("gpt2-causal") and extents("gpt2-causal:window=256,0") == {"tile"}


def test_table_key_fields():
    """The key holds softcap as a flag and the window's span as a power of two; dense keys stay as they were."""
    dense = TableKey.for_shape(parse_shape("gpt2"), "H100", "9.0")
    assert "softcap" not in dense.as_dict() and "window_bucket" not in dense.as_dict()
    key = TableKey.for_shape(parse_shape("gpt2:softcap=50:window=100,0"), "H100", "9.0")
    assert key.softcap and key.window_bucket == 128 and key.as_dict()["window_bucket"] == 128
    assert key.group() != dense.group() and "softcap window<=128" in key.spec()
    assert window_bucket(parse_shape("gpt2:window=-1,0")) == 1024


# ------------------------------------------------------------------ the kernel's window geometry (host C++)

_GEOMETRY_MAIN = r"""
#include <cstdio>
template <bool C, int M, int N> struct Traits {
    static constexpr bool kIsCausal = C, kLocal = true;
    static constexpr int kBlockM = M, kBlockN = N;
};
template <class T> void run(int seq_q, int seq_k, int left, int right) {
    const KvWindow win{seq_k - seq_q, left, right};
    for (int row0 = 0; row0 < seq_q; row0 += T::kBlockM) {
        const KvRange r = kv_tile_range<T>(row0, seq_k, win);
        std::printf("%d %d %d ", row0, r.first, r.count);
        for (int t = 0; t < r.count; ++t)
            for (int wg = 0; wg < T::kBlockM / 64; ++wg)
                std::putchar(window_holds_tile<T>((r.first + t) * T::kBlockN, row0 + 64 * wg, win) ? '1' : '0');
        std::printf("\n");
    }
    std::printf("end\n");
}
template <bool C, int M> void by_n(int n, int sq, int sk, int l, int r) {
    if (n == 64) run<Traits<C, M, 64>>(sq, sk, l, r);
    else if (n == 128) run<Traits<C, M, 128>>(sq, sk, l, r);
    else run<Traits<C, M, 176>>(sq, sk, l, r);
}
template <bool C> void by_m(int m, int n, int sq, int sk, int l, int r) {
    if (m == 64) by_n<C, 64>(n, sq, sk, l, r);
    else if (m == 128) by_n<C, 128>(n, sq, sk, l, r);
    else by_n<C, 192>(n, sq, sk, l, r);
}
int main() {
    int c, m, n, sq, sk, l, r;
    while (std::scanf("%d %d %d %d %d %d %d", &c, &m, &n, &sq, &sk, &l, &r) == 7) {
        if (c) by_m<true>(m, n, sq, sk, l, r);
        else by_m<false>(m, n, sq, sk, l, r);
    }
}
"""


@pytest.fixture(scope="module")
def window_geometry(tmp_path_factory):
    """The kernel's own KvWindow / KvRange / window_holds_tile (attention_hopper.cuh) and kv_tile_count /
    kv_tile_range (hopper/scheduler.cuh), their marked stretches compiled by the host's C++ compiler: a function of
    [(causal, block_m, block_n, shape)] -> per case, [(row0, first, count, holds flags per walked tile and stripe)]."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    cxx = shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    kernels = Path(__file__).resolve().parent.parent / "kernels"
    stretches = []
    for file, mark in (("attention_hopper.cuh", "window geometry"), ("hopper/scheduler.cuh", "persistent tile order"),
                       ("hopper/scheduler.cuh", "window tile range")):
        found = re.search(rf"// ---- {mark}.*?// ---- end of the {mark}", (kernels / file).read_text(), re.S)
        assert found, f"the marked {mark} is gone from kernels/{file}"
        stretches.append(found.group(0))
    prelude = "#include <algorithm>\nusing std::max; using std::min;\n#define __device__\n#define __forceinline__ inline\n"
    folder = tmp_path_factory.mktemp("window")
    (folder / "geometry.cpp").write_text(prelude + "\n".join(stretches) + _GEOMETRY_MAIN)
    subprocess.run([cxx, "-std=c++17", "-O1", "geometry.cpp", "-o", "geometry"], cwd=folder, check=True)

    def run(cases):
        lines = []
        for causal, m, n, shape in cases:
            v = score_mod_values(shape, 1.0)
            lines.append(f"{int(causal)} {m} {n} {shape.seq_q} {shape.seq_k} {v['window_left']} {v['window_right']}")
        out = subprocess.run([str(folder / "geometry")], input="\n".join(lines) + "\n", capture_output=True, text=True,
                             check=True).stdout
        blocks = out.split("end\n")[:-1]
        return [[(int(a), int(b), int(c), f[0] if f else "") for a, b, c, *f in (ln.split() for ln in blk.splitlines())]
                for blk in blocks]

    return run


def _window_cases():
    rng = random.Random(42)
    cases = []
    for _ in range(60):
        sq, sk = rng.randint(1, 600), rng.randint(1, 600)
        left, right = (rng.choice([-1, 0, 1, rng.randint(0, 300), 5000]) for _ in range(2))
        if left == right == -1:
            left = 0
        causal = rng.random() < 0.3
        if causal:
            sk = sq
        shape = parse_shape(f"1,1,{sq},{sk},64:window={left},{right}" + (":causal" if causal else ""))
        cases.append((causal, rng.choice([64, 128, 192]), rng.choice([64, 128, 176]), shape))
    return cases


def test_kernel_tile_range_and_masking_match_the_reference_mask(window_geometry):
    """For 60 random windows (edges 0, 1, wide, unbounded; Sq < Sk and Sq > Sk; causal; tiles 64 to 192 x 64 to 176),
    the kernel's K/V tile range per query tile holds every key a real row sees, walks no tile none sees (but one
    masked tile where no row sees any key), and a tile it leaves unmasked is visible to every row of the stripe."""
    cases = _window_cases()
    for (causal, m, n, shape), tiles in zip(cases, window_geometry(cases)):
        seen = visibility_mask(shape).numpy()
        assert len(tiles) == -(-shape.seq_q // m)
        for row0, first, count, holds in tiles:
            rows = seen[row0:row0 + m]
            keys = np.flatnonzero(rows.any(axis=0))
            where = (causal, m, n, shape.spec, row0)
            if keys.size == 0:
                assert count == 1 and 0 <= first * n < max(shape.seq_k, 1), where
                continue
            assert first * n <= keys[0] and keys[-1] < (first + count) * n, where
            assert keys[0] < (first + 1) * n and keys[-1] >= (first + count - 1) * n, where  # no idle tile at either end
            for t in range(count):
                kv0 = (first + t) * n
                for wg in range(m // 64):
                    stripe = seen[row0 + 64 * wg:row0 + 64 * (wg + 1), kv0:kv0 + n]
                    in_range = kv0 + n <= shape.seq_k and not (causal and kv0 + n - 1 > row0 + 64 * wg)
                    if holds[t * (m // 64) + wg] == "1" and in_range and stripe.size:
                        assert stripe.all(), where + (t, wg)


# ------------------------------------------------------------------ the kernel (NVRTC for sm_90a)

HOPPER = {"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4, "block_n": 128, "stages": 2,
          "q_in_regs": False}
# A sample over the Hopper pieces the window touches: one tile per CTA with a producer, persistent (strided and, causal,
# handed out), without a producer (the consumer's refill), ping-pong, three warpgroups.
KERNEL_CASES = [
    ("2,4,1000,1200,64:window=100,0", {}),
    ("4,8,1000,128:bf16:causal:window=300,0:softcap=30", {"persistent": True}),
    ("4,16,777,64:softcap=50", {"persistent": True}),
    ("2,4,777,900,64:window=64,64", {"producer_warps": 0, "pingpong": True}),
    ("2,4,700,64:bf16:window=33,7:softcap=30", {"block_m": 192, "compute_warps": 12, "block_n": 64}),
]


@pytest.mark.parametrize("text, knobs", KERNEL_CASES)
def test_hopper_kernel_compiles_clean(attention, space, text, knobs):
    """Sampled softcap / window configs compile for sm_90a with no spill, no stack frame, within the static gate."""
    from _variant_pairs import assert_compiles_clean

    shape = parse_shape(text)
    cfg = {**HOPPER, **knobs}
    assert space.violations(space.config(cfg), shape_context(shape)) == []
    _, compiled, _ = assert_compiles_clean(attention, space, shape, cfg)
    assert 0 < compiled.resources.registers <= 255


def test_traits_appear_only_on_their_shapes(attention, space):
    """A dense shape instantiates no SOFTCAP / LOCAL argument and no runtime parameter (its source, and so its SASS and
    its records' digests, stay as they were); a window shape gets both and its entry's parameters end with them."""
    from evotune.build.template import instantiate

    cfg = space.config(HOPPER)
    dense = instantiate(attention, cfg, parse_shape("gpt2")).code
    assert "/* SOFTCAP = */" not in dense and "float softcap_scale, int" not in dense
    local = instantiate(attention, cfg, parse_shape("gpt2:window=128,0")).code
    assert "/* SOFTCAP = */ false" in local and "/* LOCAL = */ true" in local and "int window_right" in local
    assert attention.entry_params(cfg, shape=parse_shape("gpt2:window=128,0"))[-3:] == SCORE_MOD_PARAMS
    assert attention.entry_params(cfg, shape=parse_shape("gpt2")) == attention.entry_params(cfg)
    with pytest.raises(UsageError, match="Hopper kernel only"):
        attention.template_args(space.config({"mma": "sync"}), parse_shape("gpt2:softcap=30"))


# ------------------------------------------------------------------ GPU (the gate: NaN poison, perturbations, tolerance)

# Enough query tiles (batch x heads x tiles above the H100's 132 SMs) that the space admits the persistent grid too.
GPU_CASES = [
    "4,20,197,300,64:window=0,0",            # window 0: each row sees one key
    "4,20,300,197,64:window=1,1",            # Sq > Sk: leading rows see no key (output 0)
    "2,40,1000,64:bf16:causal:window=4096,0:kv8",  # large window: the causal kernel's keys (handed-out persistent)
    "2,16,513,64:window=128,0:kv4",          # Mistral's causal window, ragged, GQA
    "2,24,333,64:softcap=30",
    "1,20,777,1000,128:bf16:softcap=50",
    "1,24,1000,128:bf16:causal:window=100,0:softcap=30:bshd",  # Gemma-2's local layer
]
GPU_CONFIGS = [{}, {"persistent": True}, {"producer_warps": 0, "stages": 3}, {"pingpong": True}]


@pytest.mark.gpu
@pytest.mark.parametrize("text", GPU_CASES)
@pytest.mark.parametrize("knobs", GPU_CONFIGS, ids=["onetile", "persistent", "noproducer", "pingpong"])
def test_gate_passes(attention, space, text, knobs):
    """The full gate (fresh inputs, NaN-poisoned output, perturbed keys, the fp32 reference's tolerance) passes."""
    from _variant_pairs import assert_gate_passes

    assert_gate_passes(attention, space, text, {**HOPPER, **knobs})


@pytest.mark.gpu
@pytest.mark.parametrize("text", ["2,4,300,197,64:window=1,1", "1,4,700,64:bf16:softcap=30:window=50,0"])
def test_output_and_lse_against_the_reference(attention, space, text):
    """O within the gate's tolerance of the fp32 reference and finite; rows that see no key are exactly 0 with a
    log-sum-exp of +inf, every other row's log-sum-exp finite."""
    import torch

    from _variant_pairs import run_configs

    shape = parse_shape(text)
    (out,), (lse,), inputs = run_configs(attention, space, shape, (HOPPER,), lse=True)
    ref = attention.reference(shape, inputs)
    atol, rtol = attention.tolerance(shape)
    assert torch.isfinite(out.float()).all()
    assert ((out.float() - ref).abs() <= atol + rtol * ref.abs()).all(), float((out.float() - ref).abs().max())
    empty = ~visibility_mask(shape, out.device).any(dim=1)
    assert (out[:, :, empty] == 0).all()
    assert torch.isinf(lse[:, :, empty]).all() and torch.isfinite(lse[:, :, ~empty]).all()
