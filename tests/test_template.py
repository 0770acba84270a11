"""Tests for evotune.build.template: one kernel source per (config, shape), built from the template file."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from evotune.errors import UsageError
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin, shape_context
from evotune.build.template import instantiate, kernels_dir
from _paths import REPO_ROOT

BANNER = "// ---- evotune instantiation:"


def without_banner(code: str) -> str:
    """The code less the banner comment, which names the config and so differs for any two configs."""
    return "\n".join(line for line in code.splitlines() if not line.startswith(BANNER))


def first_admitted_change(space, name, shape, base=None):
    """`base` (the default config) with `name` moved to the first other value that the space admits on `shape`."""
    default = base if base is not None else space.default_config()
    ctx = shape_context(shape)
    param = next(p for p in space.params if p.name == name)
    for value in param.values:
        if value == default[name]:
            continue
        cfg = space.config({**default.as_dict(), name: value})
        if space.admitted(cfg, ctx):
            return cfg
    return None


def test_default_instantiation(attention, space, mission):
    """The default mission source is the template text (local headers inlined), a banner, and one extern "C" entry
    with the args in order."""
    from evotune.build.template import read_template, select_flagged_lines

    _, template = read_template("attention.cu")
    template = select_flagged_lines(template, ())  # the default config has pdl false: its //[pdl] lines go
    assert '#include "attention_hopper.cuh"' in (REPO_ROOT / "kernels" / "attention.cu").read_text()
    assert '#include "' not in template
    src = instantiate(attention, space.default_config(), mission)
    assert src.family == "attention" and src.entry == "evotune_attention"
    assert src.template_path == str(kernels_dir() / "attention.cu")
    assert src.code.startswith(template)
    tail = src.code[len(template):]
    # The banner names the config's knobs but pdl at false, epilogue at regs, key_merge at gather, kv_load at
    # cp_async, kv_cluster at 1, exp2_fma at 0, rescale at always, softmax_overlap at false, lean_addressing at false,
    # p_operand at regs, empty_warpgroups at compute, causal_extent at tile and stripe_order at fixed
    # (Problem.late_knobs: the source as before the knobs).
    key = (space.default_config().key().replace(',pdl=False', '').replace(',epilogue=regs', '')
           .replace(',key_merge=gather', '').replace(',kv_load=cp_async', '').replace(',kv_cluster=1', '')
           .replace(',exp2_fma=0', '').replace(',rescale=always', '').replace(',softmax_overlap=False', '')
           .replace(',lean_addressing=False', '').replace(',p_operand=regs', '')
           .replace(',empty_warpgroups=compute', '').replace(',causal_extent=tile', '')
           .replace(',stripe_order=fixed', ''))
    assert tail.startswith(f"\n{BANNER} attention {key}\n")
    assert tail.count('extern "C"') == 1
    assert len(re.findall(r"\bevotune_attention\s*\(", tail)) == 1
    expected = [
        "/* BLOCK_M = */ 64", "/* BLOCK_N = */ 64", "/* COMPUTE_WARPS = */ 4", "/* PRODUCER_WARPS = */ 0",
        "/* STAGES = */ 2", "/* SMEM_LAYOUT = */ 2", "/* Q_IN_REGS = */ true", "/* HEAD_DIM = */ 64",
        "/* IS_BF16 = */ false", "/* IS_CAUSAL = */ false",
    ]
    positions = [tail.find(arg) for arg in expected]
    assert all(p >= 0 for p in positions), dict(zip(expected, positions))
    assert positions == sorted(positions)
    assert len(src.digest) == 16 and int(src.digest, 16) >= 0


def test_template_args_match_traits_parameters(attention, space, mission):
    """The names of template_args() are, in order, the template parameters of evotune::AttnTraits in the .cu file."""
    template = (REPO_ROOT / "kernels" / "attention.cu").read_text()
    decl = re.search(r"template\s*<([^>]*)>\s*struct\s+AttnTraits\b", template)
    assert decl, "AttnTraits declaration not found in kernels/attention.cu"
    cuda_names = [part.split()[-1].rstrip("_") for part in decl.group(1).split(",")]
    python_names = [name for name, _ in attention.template_args(space.default_config(), mission)]
    assert python_names == cuda_names


# Every knob the shipped space declares, read from the YAML, so a new knob is covered automatically.
@pytest.mark.parametrize("name", load_builtin("attention").param_names())
def test_every_knob_changes_the_code(attention, space, mission, name):
    """Changing one knob to another admitted value changes the generated code beyond the banner: from the default,
    or, for a knob only the Hopper variant reads (pingpong, persistent), from a two-warpgroup wgmma config (for
    empty_warpgroups, admitted only where a warpgroup of the last tile is empty, a three-warpgroup one), or, for
    one only key groups read (key_merge), from a two-key-group config, or for one only TMA loads read (kv_cluster),
    from a two-key-group config with kv_load = tma; on the mission shape, or for persistent (admitted only with more
    query tiles than SMs) on llama-4k, or for causal_extent (admitted only on causal shapes) on llama-4k-causal, or for
    stripe_order (admitted only with persistent and causal_extent = warpgroup) from the two-warpgroup wgmma config with
    both, on llama-4k-causal (a causal shape's base only: on the others it would find causal_extent's change first)."""
    assert name in space.param_names()
    hopper = space.config({"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4})
    key_groups = space.config({"block_m": 32, "block_n": 128, "compute_warps": 4, "warp_key_groups": 2})
    tma_loads = space.config({**key_groups.as_dict(), "kv_load": "tma"})
    hopper3 = space.config({"mma": "wgmma", "block_m": 192, "compute_warps": 12, "producer_warps": 4})
    mirror = space.config({**hopper.as_dict(), "persistent": True, "causal_extent": "warpgroup"})
    found = None
    for shape in (mission, parse_shape("llama-4k"), parse_shape("llama-4k-causal")):
        causal_bases = (mirror,) if shape.causal else ()
        for base in (space.default_config(), hopper, key_groups, tma_loads, hopper3) + causal_bases:
            cfg = first_admitted_change(space, name, shape, base)
            if cfg is not None:
                found = (cfg, base, shape)
                break
        if found:
            break
    assert found is not None, f"no admitted value of {name} other than the base's on mission or llama-4k(-causal)"
    cfg, base, shape = found
    assert without_banner(instantiate(attention, cfg, shape).code) != without_banner(instantiate(attention, base, shape).code)


@pytest.mark.parametrize("other", ["1,8,4096,64", "1,8,512,2048,64", "16,32,512,64", "mission:bshd"])
def test_code_independent_of_sizes_and_layout(attention, space, mission, other):
    """Shapes that differ only in batch, heads, sequence lengths or memory layout share one source (one cache entry)."""
    a = instantiate(attention, space.default_config(), mission)
    b = instantiate(attention, space.default_config(), parse_shape(other))
    assert a.code == b.code and a.digest == b.digest


@pytest.mark.parametrize(
    "field, value, arg",
    [("dtype", "bf16", "/* IS_BF16 = */ true"), ("causal", True, "/* IS_CAUSAL = */ true"),
     ("head_dim", 128, "/* HEAD_DIM = */ 128")],
)
def test_code_depends_on_dtype_mask_and_head_dim(attention, space, mission, field, value, arg):
    """dtype, the causal mask and head_dim are compile-time traits, so each gives different code."""
    a = instantiate(attention, space.default_config(), mission)
    b = instantiate(attention, space.default_config(), replace(mission, **{field: value}))
    assert a.code != b.code
    assert arg in b.code and arg not in a.code


def test_missing_template(attention, space, mission, tmp_path, monkeypatch):
    """With EVOTUNE_KERNELS pointing at a folder without the template, instantiate raises UsageError naming the path."""
    monkeypatch.setenv("EVOTUNE_KERNELS", str(tmp_path))
    with pytest.raises(UsageError) as info:
        instantiate(attention, space.default_config(), mission)
    assert str(info.value) == f"{tmp_path / 'attention.cu'}: kernel template not found"


def test_kernels_dir_override(attention, space, mission, tmp_path, monkeypatch):
    """EVOTUNE_KERNELS selects the folder the template is read from."""
    (tmp_path / "attention.cu").write_text("// stand-in template\n")
    monkeypatch.setenv("EVOTUNE_KERNELS", str(tmp_path))
    src = instantiate(attention, space.default_config(), mission)
    assert src.code.startswith("// stand-in template\n")
    assert src.template_path == str(tmp_path / "attention.cu")
