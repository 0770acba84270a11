"""Compiling a config (and checking that it compiled clean), one launch each of several configs on the same inputs,
and a compute-sanitizer run of one, for the tests that compare a knob's value with the value that leaves the source as
it was (tests/test_tma_store.py: epilogue; tests/test_split_merge.py: key_merge; tests/test_tma_load.py: kv_load;
tests/test_tma_multicast.py: kv_cluster; tests/test_tma_split.py: kv_load = tma_split; tests/test_exp2_fma.py:
exp2_fma; tests/test_rescale.py: rescale; tests/test_softmax_overlap.py: softmax_overlap;
tests/test_lean_addressing.py: lean_addressing; tests/test_p_operand.py: p_operand), the two checks the TMA and Hopper
ones share: the gate with the output bit for bit its twin's, and the same with the log-sum-exp, and what the Hopper ones
share: their GPU shapes, the skip of a config a shape does not admit or whose twin the static gate prunes, and a
config's test id."""

from __future__ import annotations

import math

from evotune.build.compile import compile_source
from evotune.build.template import instantiate


# ptxas's notes that it serialised the wgmma of a function (C7514, C7515, C7519: its products then wait for each other).
SERIALISED = ("C7514", "C7515", "C7519")


def serialised_notes(compiled) -> list[str]:
    """The lines of a compile log where ptxas says it serialised wgmma."""
    return [line for line in compiled.log.splitlines() if any(code in line for code in SERIALISED)]


# The GPU shapes of the Hopper kernel's knob tests (tests/test_rescale.py, test_softmax_overlap.py,
# test_lean_addressing.py and test_p_operand.py): ragged, Sq != Sk, BSHD, causal, GQA, bf16, d128, one query row, and
# two with more query tiles than the 132 SMs for the persistent grid.
HOPPER_SHAPES = ["gpt2", "2,3,200,333,64", "2,4,257,64:bshd", "1,4,1000,64:bf16:causal", "3,2,77,300,64:causal",
                 "1,8,512,64:causal:kv4", "1,2,1,64", "1,2,300,128:causal", "1,4,1100,128:bf16",
                 "2,16,1100,1300,64:bf16:causal", "2,32,1000,128:kv8"]


# The shapes of the Hopper knob tests' clean-compile checks (CPU): d64 and d128, causal, bf16, BSHD, ragged.
COMPILE_SHAPES = ["gpt2", "2,3,300,333,64:bf16:causal:bshd", "1,2,200,128:causal", "llama-4k:bf16"]


def without_if0(code: str) -> str:
    """`code` without its `#if 0` ... `#endif` stretches (the lines a flag turns off), nested ones (p_smem's inside
    softmax_overlap's) included."""
    kept, depth = [], 0
    for line in code.splitlines(keepends=True):
        directive = line.strip()
        if depth:
            depth += directive.startswith("#if") - (directive == "#endif")
        elif directive == "#if 0":
            depth = 1
        else:
            kept.append(line)
    return "".join(kept)


def skip_if_twin_pruned(attention, space, shape, twin) -> None:
    """pytest.skip when the twin config (a dict of knobs) spills: three consumer warpgroups at head dim 128 (160
    registers each), which the static gate prunes whatever the knob under test."""
    import pytest

    spilled = compile_config(attention, space, shape, twin)[2].resources.spill_stores
    if spilled:
        pytest.skip(f"the twin spills as well ({spilled} B): pruned by the static gate")


def skip_unless_admitted(attention, space, shape, cfg, twin) -> None:
    """pytest.skip when `space` does not admit the config `cfg` (a dict of knobs) on `shape`, or when its twin spills
    (skip_if_twin_pruned)."""
    import pytest

    if not space.admitted(space.config(dict(cfg)), attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    skip_if_twin_pruned(attention, space, shape, twin)


def hopper_config_id(c: dict) -> str:
    """A pytest id for a Hopper config given as a dict: tile, warps, stages, where Q lives, persistent, ping-pong."""
    return (f"M{c['block_m']}N{c['block_n']}cw{c['compute_warps']}pw{c['producer_warps']}st{c['stages']}"
            f"{'qreg' if c['q_in_regs'] else 'qsmem'}{'pers' if c['persistent'] else ''}"
            f"{'pp' if c['pingpong'] else ''}")


def compile_config(attention, space, shape, cfg):
    """(config, source, Compiled) of a config given as a dict of knobs over `space`'s defaults (CPU: NVRTC only)."""
    config = space.config(dict(cfg))
    src = instantiate(attention, config, shape)
    return config, src, compile_source(src.code, src.entry)


def assert_gate_passes(attention, space, text, cfg, skip_spills: bool = False) -> None:
    """The family's full gate (fresh inputs, NaN-poisoned output, perturbed keys, the fp32 reference's tolerance) on
    the shape spelled `text`, for a config given as a dict of knobs; skipped where the shape does not admit it, and
    with skip_spills where it spills (the static gate prunes it)."""
    import pytest

    from evotune.gpu.evaluate import evaluate_compiled
    from evotune.problems.shapes import parse_shape
    from evotune.records import result as R
    from evotune.space.searchspace import shape_context

    shape = parse_shape(text)
    if space.violations(space.config(cfg), shape_context(shape)):
        pytest.skip("not admitted on this shape")
    config, _, compiled = compile_config(attention, space, shape, cfg)
    if skip_spills and compiled.resources.spill_stores:
        pytest.skip("spills: pruned by the static gate")
    res = evaluate_compiled(attention, shape, config, compiled, time_it=False)
    assert res.status == R.OK, res.message


def assert_compiles_clean(attention, space, shape, cfg):
    """(config, Compiled, launch geometry) of a config given as a dict, after checking it compiled for sm_90a with no
    stack frame, no spill and within the static gate (registers, setmaxnreg split, shared memory) for its launch."""
    from evotune.build.compile import launch_violations

    config, _, compiled = compile_config(attention, space, shape, cfg)
    geo = attention.geometry(config, shape)
    res = compiled.resources
    assert res.stack_frame == 0 and res.spill_stores == 0, res
    assert not launch_violations(res, geo)
    return config, compiled, geo


def sanitize_config(attention, space, shape, cfg, tool: str) -> dict:
    """compute-sanitizer `tool`'s report (evotune.gpu.sanitize.run_tool) on one launch of a config given as a dict."""
    from evotune.gpu.sanitize import run_tool
    from evotune.gpu.workers import compiled_to_dict

    config, _, compiled = compile_config(attention, space, shape, cfg)
    return run_tool(tool, {"family": "attention", "shape": shape.as_dict(), "config": config.as_dict(),
                           "compiled": compiled_to_dict(compiled)})


def assert_sanitizer_clean(attention, space, shape, cfg, tool: str) -> None:
    """compute-sanitizer `tool` finds nothing on one launch of a config given as a dict (sanitize_config)."""
    report = sanitize_config(attention, space, shape, cfg, tool)
    assert report["clean"], f"{report['summary']}\n{report['output_tail']}"


def covering_sample(configs) -> list:
    """The configs of `configs` (in order) that take a (knob, value) pair no config before them in the sample took:
    a dozen or two that between them take every value each knob takes in `configs`, so every branch the template
    selects by a knob's value. A source is a function of its config, so comparing these compares what comparing all
    (thousands of instantiations, minutes on CI's 2 cores) would."""
    taken, sample = set(), []
    for c in configs:
        new = set(c.items) - taken
        if new:
            taken |= new
            sample.append(c)
    return sample


def assert_same_sources(attention, configs, other_space, shape, drop: str | None = None) -> None:
    """Each of a covering sample of `configs` (Config objects) instantiates on `shape` to the source of the same
    knobs, less `drop`, in `other_space`: a narrower space's configs, or a knob's configs at the value that keeps the
    source as it was."""
    for c in covering_sample(configs):
        knobs = {k: v for k, v in c.as_dict().items() if k != drop}
        twin = other_space.config(knobs)
        assert instantiate(attention, c, shape).digest == instantiate(attention, twin, shape).digest


def run_configs(attention, space, shape, configs, seed=5, lse=False):
    """([output per config], [lse per config] or Nones, inputs): one launch of each config on the same inputs,
    outputs filled with NaN first; with `lse`, the training variant (write_lse) of each. Each config compiles only
    the kernel it launches."""
    import torch

    from evotune.build.compile import load_kernel

    inputs = attention.make_inputs(shape, seed)
    outs, lses = [], []
    for c in configs:
        config = space.config(dict(c))
        src = instantiate(attention, config, shape, **({"write_lse": True} if lse else {}))
        kernel = load_kernel(compile_source(src.code, src.entry), attention.launch_plan(config, shape).dynamic_smem)
        out = attention.new_output(inputs).fill_(math.nan)
        lse_t = torch.full((shape.batch, shape.heads, shape.seq_q), math.nan, device=out.device) if lse else None
        attention.launcher(kernel, config, shape, inputs, out, lse_t)()
        torch.cuda.synchronize()
        outs.append(out)
        lses.append(lse_t)
    return outs, lses, inputs


def assert_gate_and_twin(attention, space, shape, cfg, twin) -> None:
    """The full gate (stray writes, unwritten output, perturbations) passes for the config `cfg` on `shape`, and its
    output is finite and bit for bit that of the config `twin` (both dicts of knobs over `space`'s defaults)."""
    import torch

    from evotune.gpu.evaluate import evaluate_compiled
    from evotune.records import result as R

    config, _, compiled = compile_config(attention, space, shape, cfg)
    res = evaluate_compiled(attention, shape, config, compiled, time_it=False)
    assert res.status == R.OK, res.message
    (out, twin_out), _, _ = run_configs(attention, space, shape, (cfg, twin))
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out, twin_out), f"max difference {float((out.float() - twin_out.float()).abs().max()):.3g}"


def assert_twin_where_admitted(attention, space, shape_text: str, cfg, twin) -> None:
    """assert_gate_and_twin on the shape `shape_text`, skipped (skip_unless_admitted) where `space` does not admit
    `cfg` there or the twin spills."""
    from evotune.problems.shapes import parse_shape

    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, space, shape, cfg, twin)
    assert_gate_and_twin(attention, space, shape, cfg, twin)


def assert_lse_twin(attention, space, shape, cfg, twin) -> None:
    """The training variant (write_lse) of `cfg` on `shape`: O and the log-sum-exp bit for bit `twin`'s, the
    log-sum-exp finite."""
    import torch

    (out, twin_out), (lse, twin_lse), _ = run_configs(attention, space, shape, (cfg, twin), lse=True)
    assert torch.equal(out, twin_out)
    assert torch.isfinite(lse).all() and torch.equal(lse, twin_lse)
