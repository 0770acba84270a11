"""Tests for the attention family's pdl knob (programmatic dependent launch, docs/PDL.md): on the CPU, the flagged
template lines (instrumentation only), pdl as a traits parameter, the griddepcontrol instructions in the SASS and their place, the
launch plan's flag on both launch paths, and the spaces; on the GPU (marked `gpu`), the gate on several shapes and
the hazard a misplaced griddepcontrol.wait would let through."""

from __future__ import annotations

import re

import pytest

from evotune.build.compile import compile_source
from evotune.build.template import instantiate, select_flagged_lines, template_flag_names, read_template
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import Config, load_builtin

# The mission winner (runs/mission-h100-exhaustive-small/best.json) and configs that take the kernels' other paths
# to global memory: producer warps, split-KV (workspace and arrival counters), the Hopper variant's TMA, and its
# causal persistent grid (tile counters).
MISSION = dict(block_m=32, block_n=128, compute_warps=4, kv_splits=1, producer_warps=0, q_in_regs=True,
               smem_layout="swizzle", stages=4, warp_key_groups=2)
PRODUCERS = dict(block_m=64, block_n=64, compute_warps=4, producer_warps=2, stages=3, smem_layout="pad",
                 q_in_regs=False, kv_splits=2, warp_key_groups=1)
_W = dict(mma="wgmma", block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=False,
          smem_layout="swizzle", kv_splits=1, warp_key_groups=1, pingpong=False)
WGMMA_PERSISTENT = dict(_W, persistent=True)
WGMMA_NO_PRODUCER = dict(_W, block_m=64, compute_warps=4, producer_warps=0)

def test_flagged_lines_are_kept_or_dropped_whole():
    """`//[flag] code` keeps `code` at its indentation where the flag is on and drops the whole line otherwise."""
    text = "a\n    //[pdl] x();\n//[pdl]\n    //[other] y();\nb\n"
    assert select_flagged_lines(text, ()) == "a\nb\n"
    assert select_flagged_lines(text, {"pdl"}) == "a\n    x();\n\nb\n"
    assert template_flag_names(text) == {"pdl", "other"}


def test_a_line_with_two_flags_is_code_only_where_both_are_on():
    """`//[a] //[b] code` (where two knobs' code meets) keeps `code` where a and b are on and drops the line where
    either is off; both names are the template's flags."""
    text = "a\n    //[pdl]     //[other] z();\nb\n"
    assert select_flagged_lines(text, {"pdl", "other"}) == "a\n        z();\nb\n"
    for flags in ((), {"pdl"}, {"other"}):
        assert select_flagged_lines(text, flags) == "a\nb\n"
    assert template_flag_names(text) == {"pdl", "other"}


def test_the_kernels_flag_known_knobs_only():
    """The attention template's flagged lines are instrumentation only: trace (tools/phase_trace.py's stamps),
    trace_split and trace_tma (its stamps in the split merge and the TMA loads) and no_wg_overlap (the baseline
    `tools/time_configs.py --with-flag` measures), never a searched config's, and nothing else (a misspelt flag would
    drop its lines). Every searched variant is a traits template parameter, so a config keeps no flag."""
    _, template = read_template("attention.cu")
    assert template_flag_names(template) == {"trace", "trace_split", "trace_tma", "no_wg_overlap"}


@pytest.mark.parametrize("shape_text, cfg", [("mission", MISSION), ("2,16,1024,64:causal", WGMMA_PERSISTENT),
                                             ("16,12,1024,64:bf16:causal:bshd", PRODUCERS)],
                         ids=["mission", "persistent", "producers-splitkv"])
def test_pdl_is_a_traits_parameter(attention, shape_text, cfg):
    """pdl is the traits' template parameter PDL (kPdl, read by an `if constexpr` before the first global access): a
    config without the key and one with pdl false are one source, pdl true another, named in the banner."""
    shape = parse_shape(shape_text)
    sources = [instantiate(attention, Config.from_dict({**cfg, **extra}), shape)
               for extra in ({}, {"pdl": False}, {"pdl": True})]
    assert sources[0].digest == sources[1].digest != sources[2].digest
    assert "/* PDL = */ false," in sources[0].code and "/* PDL = */ true," in sources[2].code
    assert "if constexpr (T::kPdl)" in sources[2].code and not re.search(r"^\s*//\[pdl\]", sources[2].code, re.M)
    assert "pdl=True" in sources[2].code.split("// ---- evotune instantiation:")[1].splitlines()[0]


# SASS opcodes that may read or write global memory (generic LD/ST/ATOM too: they may point there). UTMAPF,
# the tensor-map prefetch, reads the map from the kernel's parameters and is left out.
GLOBAL_OPS = ("LDG", "STG", "LDGSTS", "ATOMG", "RED", "REDG", "ATOM", "LD", "ST", "UTMALDG", "UTMASTG", "UTMAREDG",
              "UBLKCP", "UBLKRED")
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


@pytest.mark.parametrize("shape_text, cfg", [("mission", MISSION), ("16,12,1024,64:bf16:causal", PRODUCERS),
                                             ("2,16,1024,64:causal", WGMMA_PERSISTENT), ("mission", WGMMA_NO_PRODUCER)],
                         ids=["mission-winner", "producers-splitkv", "wgmma-persistent-causal", "wgmma-no-producer"])
def test_pdl_sass_waits_before_any_global_access(attention, cuobjdump, shape_text, cfg):
    """pdl true compiles to griddepcontrol.wait (ACQBULK) and launch_dependents (PREEXIT), once each, with no
    instruction that may touch global memory before the wait; pdl false has neither, with the same registers."""
    from evotune.build.sass import disassemble

    shape = parse_shape(shape_text)
    listings = {}
    for pdl in (False, True):
        src = instantiate(attention, Config.from_dict({**cfg, "pdl": pdl}), shape)
        compiled = compile_source(src.code, src.entry)
        listings[pdl] = (compiled.resources, [(int(a, 16), op) for a, op in _SASS_LINE.findall(disassemble(compiled.cubin_path))])
    (res_off, off), (res_on, on) = listings[False], listings[True]
    assert not {"ACQBULK", "PREEXIT"} & {op for _, op in off}
    assert [op for _, op in on].count("ACQBULK") == 1 and [op for _, op in on].count("PREEXIT") == 1
    wait = next(a for a, op in on if op == "ACQBULK")
    touching = [(a, op) for a, op in on if op in GLOBAL_OPS]
    assert touching and min(touching)[0] > wait, min(touching)
    assert res_on.spill_stores == res_on.spill_loads == res_on.stack_frame == 0
    assert res_on.registers == res_off.registers


def test_launch_plan_carries_pdl(attention, space, mission):
    """The launch plan says pdl exactly where the config does; a recorded config without the key is not pdl."""
    recorded = Config.from_dict(MISSION)
    assert attention.launch_plan(recorded, mission).pdl is False
    assert attention.launch_plan(space.config({**MISSION, "pdl": False}), mission).pdl is False
    on = attention.launch_plan(space.config({**MISSION, "pdl": True}), mission)
    assert on.pdl is True and on.grid == attention.launch_plan(recorded, mission).grid
    assert attention.launch_plan(space.config({**WGMMA_PERSISTENT, "pdl": True}), parse_shape("2,16,1024,64:causal")).pdl


@pytest.mark.parametrize("cfg", [MISSION, WGMMA_NO_PRODUCER], ids=["sync", "wgmma"])
def test_problem_launcher_passes_pdl(attention, monkeypatch, mission, cfg):
    """The family's launcher (the search's evaluation and the gate) asks torch_stream_launcher for a PDL launch
    exactly for a pdl config."""
    import evotune.build.compile

    told = []
    monkeypatch.setattr(evotune.build.compile, "torch_stream_launcher",
                        lambda kernel, grid, block, args, smem, keep=(), pdl=False: told.append(pdl))
    monkeypatch.setattr("evotune.build.tma.encode_tiled", lambda address, args: bytes(128))
    inputs = attention.make_inputs(mission, 0, device="cpu")  # CPU tensors: never launched
    for pdl in (False, True):
        attention.launcher(None, Config.from_dict({**cfg, "pdl": pdl}), mission, inputs, attention.new_output(inputs))
    attention.launcher(None, Config.from_dict(cfg), mission, inputs, attention.new_output(inputs))
    assert told == [False, True, False]


def test_prepared_launch_passes_pdl(monkeypatch, mission):
    """The op's PreparedLaunch launches a pdl config's kernel through launch_packet with pdl, any other without."""
    torch = pytest.importorskip("torch")
    import evotune.gpu.packet
    from evotune.torch import kernels as K

    told = []
    monkeypatch.setattr(evotune.gpu.packet, "launch_packet",
                        lambda fn, grid, block, smem, stream, packet, pdl=False: told.append((fn, grid, pdl)))
    monkeypatch.setattr(K, "current_stream_handle", lambda index: 0)

    class Fn:
        ptr = 0xF00

    class Raw:
        kernel = Fn()

    q, k, v = (torch.randn(1, 8, 512, 64).half() for _ in range(3))
    for pdl in (False, True):
        loaded = K.LoadedKernel(Raw(), Config.from_dict({**MISSION, "pdl": pdl}), 0, "digest", "none.cubin")
        K.PreparedLaunch(loaded, mission, (q.stride(), k.stride(), v.stride()), 0.125)(q, k, v, torch.empty_like(q))
    assert told == [(0xF00, (16, 8, 1), False), (0xF00, (16, 8, 1), True)]


def test_export_header_says_how_to_launch_pdl(attention, mission):
    """A pdl config's launch notes say to launch with programmatic stream serialization (and that a plain launch is
    correct); a pdl-false config's say nothing of it."""
    on = attention.launch_notes(Config.from_dict({**MISSION, "pdl": True}), mission)
    assert any("cudaLaunchAttributeProgrammaticStreamSerialization" in n for n in on)
    assert not any("pdl" in n for n in attention.launch_notes(Config.from_dict(MISSION), mission))


def test_spaces_with_and_without_pdl(attention, mission):
    """The exhaustive oracles and the Hopper spaces keep their sizes (pdl omitted); attention-small-pdl is
    attention-small's admitted configs each with pdl false and true, the false ones the same sources; attention.yaml
    admits pdl on the mission shape and not where a call takes 100 us or more."""
    sizes = {name: (load_builtin(name).size(), len(load_builtin(name).admitted_configs(attention.context(mission))))
             for name in ("attention-small", "attention-hopper", "attention-small-pdl")}
    assert sizes == {"attention-small": (972, 456), "attention-hopper": (384, 126), "attention-small-pdl": (1944, 912)}
    for name in ("attention-small", "attention-hopper", "attention-hopper3"):
        assert "pdl" not in load_builtin(name).param_names()
    small = load_builtin("attention-small").admitted_configs(attention.context(mission))
    with_pdl = load_builtin("attention-small-pdl").admitted_configs(attention.context(mission))
    assert sorted(c.items for c in with_pdl) == sorted(Config.from_dict({**c.as_dict(), "pdl": p}).items
                                                        for c in small for p in (False, True))
    for c in small[:3]:
        assert (instantiate(attention, c, mission).digest
                == instantiate(attention, Config.from_dict({**c.as_dict(), "pdl": False}), mission).digest)
    full = load_builtin("attention")
    for shape_text, admitted in (("mission", True), ("2,8,1024,64", True), ("gpt2", False), ("llama-4k", False)):
        cfg = full.config({"block_m": 64, "block_n": 64, "pdl": True})
        assert full.admitted(cfg, attention.context(parse_shape(shape_text))) == admitted, shape_text


# --------------------------------------------------------------------------- GPU


def _gate(attention, space, shape_text, cfg, time_it=False):
    from evotune.gpu.evaluate import evaluate_compiled

    shape = parse_shape(shape_text)
    config = space.config({**cfg, "pdl": True})
    if not space.admitted(config, dict(attention.context(shape), multiprocessors=0)):
        pytest.skip("config not admitted for this shape")
    assert attention.launch_plan(config, shape).pdl
    src = instantiate(attention, config, shape)
    return evaluate_compiled(attention, shape, config, compile_source(src.code, src.entry), time_it=time_it)


GATE_SHAPES = ["mission", "mission:causal", "mission:bf16", "2,3,200,333,64", "1,4,1000,128:bf16:causal",
               "2,4,257,64:bshd", "1,8,512,64:causal:kv4"]


@pytest.mark.gpu
@pytest.mark.parametrize("shape_text", GATE_SHAPES)
@pytest.mark.parametrize("cfg", [MISSION, PRODUCERS, WGMMA_NO_PRODUCER, WGMMA_PERSISTENT],
                         ids=["mission-winner", "producers-splitkv", "wgmma", "wgmma-persistent"])
def test_pdl_configs_pass_the_gate(attention, space, shape_text, cfg):
    """pdl-true configs of both variants, launched with programmatic stream serialization, pass the full gate on
    the mission shape, causal, bf16, d128, ragged, BSHD and grouped K/V heads."""
    from evotune.records import result as R

    res = _gate(attention, space, shape_text, cfg)
    assert res.status in (R.OK, R.PRUNED), res.message
    if res.status == R.OK:
        assert res.verification["nonfinite"] == 0 and res.verification["gate_ratio"] <= 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [MISSION, WGMMA_NO_PRODUCER], ids=["mission-winner", "wgmma"])
def test_pdl_timed_in_a_graph(attention, space, cfg):
    """A pdl config is timed as the search times it, CUDA-graph replays of back-to-back PDL launches (the capture
    takes the attribute), and the timed launches' output passes the audit."""
    from evotune.records import result as R

    res = _gate(attention, space, "mission", cfg, time_it=True)
    assert res.status == R.OK, res.message
    assert res.timing["method"] == "cuda-graph" and res.time_us > 0


# A kernel that lets the next PDL-launched grid start at once (launch_dependents first), then waits `delay_ns` and
# only then writes new Q, K and V: a grid launched after it with programmatic stream serialization runs under it,
# so whatever that grid reads of Q, K, V before its griddepcontrol.wait is the old values.
LATE_WRITER = r"""
extern "C" __global__ void late_writer(const uint4* __restrict__ sq, uint4* dq, long long nq,
                                       const uint4* __restrict__ sk, uint4* dk, const uint4* __restrict__ sv,
                                       uint4* dv, long long nkv, unsigned long long delay_ns) {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t)); } while (t - t0 < delay_ns);
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < nq; i += step) dq[i] = sq[i];
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < nkv; i += step) { dk[i] = sk[i]; dv[i] = sv[i]; }
}
"""
LATE_WRITER_DELAY_NS = 2_000_000  # 2 ms: far longer than the launches queued after it and the attention itself


def _hazard_setup(attention, space, cfg, shape_text, without_wait=False):
    """(old inputs, new inputs, out, the pdl kernel's launch on the old buffers); `without_wait`: the same kernel
    with its griddepcontrol.wait taken out (the misplacement the hazard tests must catch)."""
    from evotune.build.compile import load_kernel

    shape = parse_shape(shape_text)
    config = space.config({**cfg, "pdl": True})
    src = instantiate(attention, config, shape)
    code = src.code.replace("pdl_wait();", "") if without_wait else src.code
    assert (code != src.code) == without_wait
    kernel = load_kernel(compile_source(code, src.entry), attention.launch_plan(config, shape).dynamic_smem)
    old, new = attention.make_inputs(shape, 11), attention.make_inputs(shape, 12)
    out = attention.new_output(old)
    return shape, old, new, out, attention.launcher(kernel, config, shape, old, out)


def _late_writer(old, new):
    """A launcher of LATE_WRITER copying `new` Q, K, V into `old`'s buffers on torch's current stream."""
    import numpy as np

    from evotune.build.compile import load_kernel, torch_stream_launcher

    writer = load_kernel(compile_source(LATE_WRITER, "late_writer"))
    assert writer.kernel.ptr  # the function is loaded now, not on its first call (which may be inside a capture)
    assert all(t[n].is_contiguous() for t in (old, new) for n in "qkv")

    def ptr(t):
        return np.uint64(t.data_ptr())

    def chunks(t):  # 16-byte vectors
        return np.int64(t.numel() * t.element_size() // 16)

    args = (ptr(new["q"]), ptr(old["q"]), chunks(old["q"]), ptr(new["k"]), ptr(old["k"]), ptr(new["v"]),
            ptr(old["v"]), chunks(old["k"]), np.uint64(LATE_WRITER_DELAY_NS))
    return torch_stream_launcher(writer, (8, 1, 1), (256, 1, 1), args)


def _matches(attention, shape, out, inputs) -> bool:
    from evotune.gpu.evaluate import output_errors

    atol, rtol = attention.tolerance(shape)
    _, _, nonfinite, ratio = output_errors(out, attention.reference(shape, inputs), atol * attention.error_scale(inputs),
                                           rtol)
    return nonfinite == 0 and ratio <= 1.0


def _run(launches, graph: bool) -> None:
    """The launches in order on one stream: eagerly, or captured into a CUDA graph and replayed once."""
    import torch

    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for launch in launches:
                launch()
        g.replay()
    else:
        for launch in launches:
            launch()
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("cfg", [MISSION, WGMMA_NO_PRODUCER], ids=["mission-winner", "wgmma"])
def test_pdl_reads_what_a_torch_kernel_wrote_just_before(attention, space, cfg, graph):
    """torch kernels write fresh Q, K, V immediately before a PDL launch of ours on the same stream: the output is
    the new values' attention, eagerly and from a CUDA graph."""
    shape, old, new, out, launch = _hazard_setup(attention, space, cfg, "mission")
    out.fill_(float("nan"))
    copies = [lambda d=old[n], s=new[n]: d.copy_(s) for n in "qkv"]
    _run(copies + [launch], graph)
    assert _matches(attention, shape, out, new)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("cfg", [MISSION, PRODUCERS, WGMMA_NO_PRODUCER, WGMMA_PERSISTENT],
                         ids=["mission-winner", "producers-splitkv", "wgmma", "wgmma-persistent"])
def test_pdl_waits_for_a_kernel_that_lets_it_start_early(attention, space, cfg, graph):
    """After a kernel that triggers its dependents at once and writes new Q, K, V 2 ms later, our PDL launch (which
    starts under it) still computes on the new values: every global read follows griddepcontrol.wait."""
    shape_text = "2,16,1024,64:causal" if cfg.get("persistent") else "mission"
    shape, old, new, out, launch = _hazard_setup(attention, space, cfg, shape_text)
    out.fill_(float("nan"))
    _run([_late_writer(old, new), launch], graph)
    assert _matches(attention, shape, out, new)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_pdl_overlap_is_real_without_the_wait(attention, space, graph):
    """The control that gives the test above its teeth: the same kernel without its griddepcontrol.wait, launched
    the same way, reads the OLD Q, K, V (it ran under the writer). If this fails, the launch did not overlap the
    previous kernel (the attribute had no effect here), and the pdl tests and timings measured no PDL at all."""
    shape, old, new, out, launch = _hazard_setup(attention, space, MISSION, "mission", without_wait=True)
    out.fill_(float("nan"))
    before = {n: old[n].clone() for n in "qkv"}
    _run([_late_writer(old, new), launch], graph)
    assert all(bool((old[n] == new[n]).all()) for n in "qkv")  # the writer did write
    assert _matches(attention, shape, out, {**old, **before}), "no overlap: the kernel saw the writer's new values"
    assert not _matches(attention, shape, out, new)
