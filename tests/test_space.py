"""Tests for evotune.space.searchspace: the YAML search-space loader, the data model and the safe evaluator."""

from __future__ import annotations

import dataclasses

import hashlib
import json
import re
import textwrap
from pathlib import Path

import pytest

from evotune.errors import UsageError
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import (
    CONTEXT_NAMES,
    Config,
    ExpressionError,
    builtin_names,
    check_nonempty,
    load_builtin,
    load_space,
    safe_eval,
    shape_context,
)

ATTENTION_YAML = Path(__file__).resolve().parents[1] / "search_spaces" / "attention.yaml"


@pytest.fixture(scope="module")
def space():
    return load_space(ATTENTION_YAML)


@pytest.fixture(scope="module")
def mission():
    return shape_context(parse_shape("mission"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


# --------------------------------------------------------------------------- the real attention space


def test_attention_loads(space):
    """The shipped attention.yaml loads with its twenty-five parameters (the variant knob mma first), nine derived values
    (V's tile width and row bytes beside Q's and K's: a value head dim of its own) and forty-two constraints, each with
    its reason: thirty-nine of validity and three measured priors, each of those naming its evidence."""
    assert space.family == "attention"
    assert space.path == str(ATTENTION_YAML)
    assert space.param_names() == ["mma", "block_m", "block_n", "compute_warps", "producer_warps", "stages",
                                   "smem_layout", "q_in_regs", "kv_splits", "warp_key_groups", "pingpong", "persistent",
                                   "pdl", "epilogue", "key_merge", "kv_load", "kv_cluster", "exp2_fma", "rescale",
                                   "softmax_overlap", "lean_addressing", "p_operand", "empty_warpgroups",
                                   "causal_extent", "stripe_order"]
    assert [name for name, _, _ in space.derived] == ["threads", "row_groups", "rows_per_warp", "tile_dim", "tile_dim_v",
                                                     "row_bytes", "row_bytes_v", "smem_bytes", "acc_regs"]
    assert len(space.constraints) == 42
    assert all(c.why for c in space.constraints)
    assert sum(c.measured for c in space.constraints) == 3 and all(c.evidence for c in space.constraints if c.measured)
    assert space.params[0].values == ("sync", "wgmma") and space.params[0].default == "sync"
    block_m = space.params[1]
    assert block_m.values == (16, 32, 64, 128, 192, 256) and block_m.default == 64 and block_m.line == 15
    assert space.params[-19].values == ("pad", "swizzle", "plain")
    assert space.params[-18].values == (True, False)
    assert space.params[-17].values == (1, 2, 4, 8)
    assert space.params[-16].values == (1, 2, 4)
    assert space.params[-15].values == (False, True)
    assert space.params[-14].values == (False, True) and space.params[-14].default is False
    assert space.params[-13].values == (False, True) and space.params[-13].default is False
    assert space.params[-12].values == ("regs", "tma") and space.params[-12].default == "regs"
    assert space.params[-11].values == ("gather", "split") and space.params[-11].default == "gather"
    assert space.params[-10].values == ("cp_async", "tma", "tma_split") and space.params[-10].default == "cp_async"
    assert space.params[-9].values == (1, 2, 4) and space.params[-9].default == 1
    assert space.params[-8].values == (0, 1, 2) and space.params[-8].default == 0
    assert space.params[-7].values == ("always", "new_max", "lazy") and space.params[-7].default == "always"
    assert space.params[-6].values == (False, True) and space.params[-6].default is False
    assert space.params[-5].values == (False, True) and space.params[-5].default is False  # lean_addressing
    assert space.params[-4].values == ("regs", "smem") and space.params[-4].default == "regs"  # p_operand
    assert space.params[-3].values == ("compute", "skip") and space.params[-3].default == "compute"  # empty_warpgroups
    assert space.params[-2].values == ("tile", "warpgroup") and space.params[-2].default == "tile"  # causal_extent
    assert space.params[-1].values == ("fixed", "mirrored") and space.params[-1].default == "fixed"  # stripe_order


def test_wgmma_pins_the_knobs_it_does_not_read(space, attention):
    """Admitted wgmma configs have 64 rows per consumer warpgroup and a whole producer warpgroup or none; moving a
    knob the Hopper variant does not read (smem_layout, kv_splits, warp_key_groups) off its pinned value is refused,
    so no two admitted configs compile to the same code; and the mma.sync slice keeps its old producer values."""
    import itertools

    from evotune.problems.shapes import parse_shape
    from evotune.build.template import instantiate

    shape = parse_shape("4,32,4096,128")
    ctx = attention.context(shape)
    values = {p.name: p.values for p in space.params}
    read = ("block_m", "block_n", "compute_warps", "producer_warps", "stages", "q_in_regs", "pingpong")
    admitted = []
    for combo in itertools.product(*(values[n] for n in read)):
        cfg = space.config({"mma": "wgmma", **dict(zip(read, combo))})
        if space.violations(cfg, ctx):
            continue
        admitted.append(cfg)
        assert cfg["block_m"] == 16 * cfg["compute_warps"] and cfg["producer_warps"] in (0, 4)
        assert not cfg["pingpong"] or cfg["compute_warps"] == 8
        for name in ("smem_layout", "kv_splits", "warp_key_groups"):
            for other in values[name]:
                if other != cfg[name]:
                    assert space.violations(space.config({**cfg.as_dict(), name: other}), ctx), (name, other)
    # attention-hopper3.yaml leaves out block_n 16: 172 is what `evotune check --space` compiles for it on this d128
    # shape (attention-hopper.yaml, without the three-warpgroup and 176-key tiles: 114); the four-warpgroup tile
    # (block_m 256, which attention-hopper3.yaml leaves out) adds 34 (keys up to 128); all of those at 1-4 stages,
    # the values those files listed: the deep ring's 5-8 (the root's since the priors' deep-ring winners had to be
    # admitted there to be asked) adds the rest
    ring = [c for c in admitted if c["stages"] <= 4]
    assert len([c for c in ring if c["block_n"] != 16 and c["compute_warps"] <= 12]) == 172
    assert len([c for c in ring if c["block_n"] != 16 and c["compute_warps"] == 16]) == 34
    assert len([c for c in ring if c["block_n"] not in (16, 176) and c["compute_warps"] <= 8]) == 114
    assert len(ring) < len(admitted)
    assert len({instantiate(attention, c, shape).code for c in admitted}) == len(admitted)
    for pw, pp in ((4, False), (1, True)):
        assert space.violations(space.config({"mma": "sync", "producer_warps": pw, "pingpong": pp}), ctx)


@pytest.mark.parametrize("name, most_warps, most_keys", [("attention-hopper3", 12, 176), ("attention-hopper", 8, 128)])
def test_hopper_space_is_the_wgmma_slice(space, attention, name, most_warps, most_keys):
    """search_spaces/attention-hopper3.yaml admits exactly the wgmma configs attention.yaml admits (less block_n 16,
    which it leaves out), with the same shared-memory figure, on a d128 and a d64 shape; attention-hopper.yaml the
    same without the three-warpgroup and 176-key tiles (the 126-config slice of the gpt2 oracle)."""
    import itertools

    from evotune.problems.shapes import parse_shape

    hopper = load_builtin(name)
    for text in ("4,32,4096,128", "16,12,1024,64:bf16:causal"):
        ctx = attention.context(parse_shape(text))
        mine = {c.key() for c in hopper.admitted_configs(ctx)}
        values = {p.name: p.values for p in space.params}
        values["stages"] = next(p.values for p in hopper.params if p.name == "stages")  # 1-4: no deep ring there
        names = [p.name for p in hopper.params if p.name != "mma"]
        theirs = set()
        for combo in itertools.product(*(values[n] for n in names)):
            cfg = space.config({"mma": "wgmma", **dict(zip(names, combo))})
            if (not space.violations(cfg, ctx) and cfg["block_n"] != 16 and cfg["compute_warps"] <= most_warps
                    and cfg["block_n"] <= most_keys):
                theirs.add(hopper.config({"mma": "wgmma", **dict(zip(names, combo))}).key())
                assert hopper.derive(hopper.config({"mma": "wgmma", **dict(zip(names, combo))}), ctx)["smem_bytes"] \
                    == space.derive(cfg, ctx)["smem_bytes"]
        assert mine == theirs and len(mine) > 100


def test_load_builtin_finds_attention(space):
    """load_builtin('attention') returns the same space as loading the repository's file directly (from the
    packaged copy after a wheel install, hence compared without its path)."""
    assert "attention" in builtin_names()
    assert dataclasses.replace(load_builtin("attention"), path=space.path) == space


def test_load_builtin_unknown_name_lists_available():
    """An unknown built-in name is a UsageError that lists the available spaces."""
    with pytest.raises(UsageError, match=r"unknown search space 'nope'; available: .*attention"):
        load_builtin("nope")


def test_spaces_folder_override(tmp_path, monkeypatch):
    """EVOTUNE_SPACES points load_builtin at another folder."""
    (tmp_path / "tiny.yaml").write_text("family: tiny\nparams:\n  p: {values: [1, 2]}\n")
    monkeypatch.setenv("EVOTUNE_SPACES", str(tmp_path))
    assert builtin_names() == ["tiny"]
    assert load_builtin("tiny").family == "tiny"


def test_size(space):
    """size() is the product of the value counts: 2*6*6*6*4*8*3*2*4*3*2*2*2*2*2*3*3*3*3*2*2*2*2*2*2."""
    assert space.size() == 165112971264


def test_all_configs_is_the_full_product_in_order(space):
    """all_configs() yields size() configs: the product of the parameters' values, the last parameter varying fastest,
    each config the product's config at its index, decoded in mixed radix. Every config of a smaller shipped space
    (attention-small-mc.yaml: 23,328), and every 192nd of attention.yaml's first 995,328 (5,184 configs). The knobs'
    order in attention.yaml is then read from the product's configs at every 192nd index of its first 95,551,488
    (rescale, softmax_overlap, lean_addressing, p_operand, empty_warpgroups, causal_extent and stripe_order, the last
    seven knobs, at always, false, false, regs, compute, tile and fixed: every knob but the first five then takes each
    of its values), built from the index: walking all_configs() that far took 200 s on CI's CPU (issue 38) for the
    generator code that the first million and the small space already check. The whole 165 G would take many minutes
    a pass, and two lists of them gigabytes."""
    from itertools import islice

    def product_config(space, index: int) -> dict:
        picked = {}
        for p in reversed(space.params):
            index, digit = divmod(index, len(p.values))
            picked[p.name] = list(p.values)[digit]
        return picked

    small = load_builtin("attention-small-mc")
    assert sum(1 for _ in small.all_configs()) == small.size() == 23328
    for index, cfg in enumerate(small.all_configs()):
        assert cfg.as_dict() == product_config(small, index), index
    first = list(islice(space.all_configs(), 48))
    assert [c["stripe_order"] for c in first] == ["fixed", "mirrored"] * 24
    assert [c["causal_extent"] for c in first] == ["tile", "tile", "warpgroup", "warpgroup"] * 12
    assert [c["empty_warpgroups"] for c in first] == (["compute"] * 4 + ["skip"] * 4) * 6
    assert [c["p_operand"] for c in first] == (["regs"] * 8 + ["smem"] * 8) * 3
    assert [c["lean_addressing"] for c in first] == [False] * 16 + [True] * 16 + [False] * 16
    assert [c["softmax_overlap"] for c in first] == [False] * 32 + [True] * 16
    walked = list(islice(space.all_configs(), 0, 192 * 5184, 192))
    assert all(cfg.as_dict() == product_config(space, 192 * index) for index, cfg in enumerate(walked))
    prefix = [product_config(space, 192 * index) for index in range(497664)]
    assert prefix[:len(walked)] == [cfg.as_dict() for cfg in walked]
    assert all(len({c[p.name] for c in prefix}) == len(p.values) for p in space.params[5:-7])
    assert product_config(space, space.size() - 1) == {p.name: list(p.values)[-1] for p in space.params}
    assert [c["exp2_fma"] for c in prefix[:3]] == [0, 1, 2]
    configs = prefix[:27 * 4608:3]  # exp2_fma 0: the knobs before it then vary as the checks below were written
    assert [c["kv_cluster"] for c in configs[:3]] == [1, 2, 4]
    assert [c["kv_load"] for c in configs[0:9:3]] == ["cp_async", "tma", "tma_split"]
    # kv_cluster 1 and kv_load cp_async or tma: the knobs before them then vary as the checks below were written
    configs = [c for c in configs[::3] if c["kv_load"] != "tma_split"]
    assert [c["kv_load"] for c in configs[:2]] == ["cp_async", "tma"]
    assert [c["key_merge"] for c in configs[0:4:2]] == ["gather", "split"]
    assert [c["epilogue"] for c in configs[0:8:4]] == ["regs", "tma"]
    assert [c["pdl"] for c in configs[0:16:8]] == [False, True]
    assert [c["persistent"] for c in configs[0:32:16]] == [False, True]
    assert [c["pingpong"] for c in configs[0:64:32]] == [False, True]
    assert [c["warp_key_groups"] for c in configs[0:192:64]] == [1, 2, 4]
    assert [c["kv_splits"] for c in configs[0:768:192]] == [1, 2, 4, 8]
    assert [c["q_in_regs"] for c in configs[0:1536:768]] == [True, False]
    assert [c["smem_layout"] for c in configs[0:4608:1536]] == ["pad", "swizzle", "plain"]
    # The first knob varies slowest: the prefix never leaves its first value (reaching the last config, wgmma, would
    # take all 82 G; attention-small-mc's full order is checked above).
    assert {c["mma"] for c in prefix} == {"sync"}


def test_shape_context_has_every_context_name(mission):
    """shape_context() provides exactly CONTEXT_NAMES, with the H100 limits."""
    assert set(mission) == set(CONTEXT_NAMES)
    assert mission["head_dim"] == 64 and mission["dtype_bytes"] == 2 and mission["causal"] is False
    assert mission["smem_limit"] == 232448 and mission["max_threads"] == 1024


def test_default_config_admitted_for_mission(space, mission):
    """The default configuration runs on the mission shape."""
    cfg = space.default_config()
    assert cfg["block_m"] == 64 and cfg["smem_layout"] == "swizzle"
    assert space.violations(cfg, mission) == []
    assert space.admitted(cfg, mission)


def test_derive_smem_bytes_by_hand(space, mission):
    """block 64x64, 2 stages, padded rows at head_dim 64: rows of 144 B, (64 + 2*2*64) * 144 bytes."""
    cfg = space.config({"block_m": 64, "block_n": 64, "compute_warps": 4, "stages": 2, "smem_layout": "pad"})
    env = space.derive(cfg, mission)
    assert env["row_bytes"] == 144
    assert env["smem_bytes"] == (64 + 256) * 144 == 46080
    assert env["threads"] == 128 and env["rows_per_warp"] == 16
    assert env["head_dim"] == 64 and env["block_m"] == 64


def test_violations_name_the_failed_why(space, mission):
    """A config that splits 16 rows over 8 warps reports the whole-tile constraint, with its expression."""
    cfg = space.config({"block_m": 16, "compute_warps": 8})
    failed = space.violations(cfg, mission)
    assert failed == ["each row group of compute warps owns a whole number of 16-row mma tiles "
                      "(block_m % (16 * row_groups) == 0)"]
    assert not space.admitted(cfg, mission)


def test_violations_shared_memory_limit(space):
    """128-row tiles with 4 stages of 128 keys at head_dim 128 exceed 227 KB."""
    ctx = shape_context(parse_shape("llama-4k"))
    cfg = space.config({"block_m": 128, "block_n": 128, "stages": 4})
    assert any("shared-memory limit" in why for why in space.violations(cfg, ctx))


def test_admitted_configs_nonempty_and_all_admitted(space, mission):
    """admitted_configs() is a nonempty strict subset of the space, and each member is admitted."""
    admitted = space.admitted_configs(mission)
    assert 0 < len(admitted) < space.size()
    assert space.default_config() in admitted
    assert all(space.violations(cfg, mission) == [] for cfg in admitted)


def test_check_nonempty(space, mission):
    """check_nonempty passes for the mission shape and names the blocking constraint for head_dim 80."""
    check_nonempty(space, mission)
    with pytest.raises(UsageError) as info:
        check_nonempty(space, shape_context(parse_shape("1,1,64,64,80")))
    message = str(info.value)
    assert message.startswith(f"{ATTENTION_YAML}: no configuration is admitted for ")
    assert "head_dim=80" in message and "written for head dims 64, 96" in message


# --------------------------------------------------------------------------- config()


def test_config_fills_defaults(space):
    """Parameters left out of config() take their defaults."""
    cfg = space.config({"block_m": 32})
    assert cfg["block_m"] == 32 and cfg["block_n"] == 64 and cfg["stages"] == 2


def test_config_rejects_unknown_name(space):
    """config() names an unknown parameter and lists the real ones."""
    with pytest.raises(UsageError, match=r"unknown parameter 'block_k'; parameters: mma, block_m, block_n"):
        space.config({"block_k": 64})


def test_config_rejects_bad_value(space):
    """config() names a value that is not allowed and lists the allowed ones."""
    with pytest.raises(UsageError, match=r"block_m=48 is not allowed; allowed: 16, 32, 64, 128"):
        space.config({"block_m": 48})


def test_config_is_type_strict(space):
    """A bool or a string is not accepted where an int is expected, although True == 1 in Python."""
    with pytest.raises(UsageError, match="producer_warps=True"):
        space.config({"producer_warps": True})
    with pytest.raises(UsageError, match="block_m='64'"):
        space.config({"block_m": "64"})


# --------------------------------------------------------------------------- Config


def test_config_hash_equality_and_keys(space):
    """Equal configs built in any key order are equal, hash equal, and share key() and digest()."""
    a = space.config({"block_m": 32, "stages": 3})
    b = Config.from_dict({**a.as_dict()})
    c = Config.from_dict(dict(reversed(list(a.as_dict().items()))))
    assert a == b == c and hash(a) == hash(b) == hash(c)
    assert len({a, b, c, space.default_config()}) == 2
    assert a.key() == c.key() == ("block_m=32,block_n=64,causal_extent=tile,compute_warps=4,empty_warpgroups=compute,epilogue=regs,exp2_fma=0,key_merge=gather,"
                                  "kv_cluster=1,kv_load=cp_async,kv_splits=1,lean_addressing=False,"
                                  "mma=sync,p_operand=regs,pdl=False,"
                                  "persistent=False,"
                                  "pingpong=False,producer_warps=0,q_in_regs=True,rescale=always,smem_layout=swizzle,"
                                  "softmax_overlap=False,"
                                  "stages=3,stripe_order=fixed,warp_key_groups=1")
    assert a.digest() == c.digest() and len(a.digest()) == 12 and int(a.digest(), 16) >= 0
    assert a.digest() != space.default_config().digest()


def test_config_mapping_methods():
    """Config supports [], get(), keys() and as_dict(), with names sorted."""
    cfg = Config.from_dict({"b": 2, "a": "x"})
    assert cfg.items == (("a", "x"), ("b", 2))
    assert cfg["b"] == 2 and cfg.get("a") == "x" and cfg.get("zz", 7) == 7
    assert cfg.keys() == ["a", "b"] and cfg.as_dict() == {"a": "x", "b": 2}
    with pytest.raises(KeyError):
        cfg["zz"]


def test_digest_is_stable():
    """digest() is the first 12 hex digits of the sha256 of the sorted JSON, so it is the same in every process."""
    d = {"smem_layout": "pad", "block_m": 64}
    expected = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]
    assert Config.from_dict(d).digest() == expected == "8f32838a2d28"


# --------------------------------------------------------------------------- safe evaluator


@pytest.mark.parametrize(
    "expr, env, expected",
    [
        ("1 + 2 * 3 - 4 // 3 % 2", {}, 6),
        ("7 / 2", {}, 3.5),
        ("2 ** 10", {}, 1024),
        ("-x", {"x": 3}, -3),
        ("not x", {"x": 0}, True),
        ("0 < x <= 4 < 5", {"x": 4}, True),
        ("0 < x < 4", {"x": 4}, False),
        ("x in (64, 128)", {"x": 128}, True),
        ("x not in [64, 128]", {"x": 96}, True),
        ("s == 'pad'", {"s": "pad"}, True),
        ("16 if s == 'pad' else 0", {"s": "swizzle"}, 0),
        ("x == 0 or 64 // x > 1", {"x": 0}, True),  # `or` short-circuits past the division by zero
        ("x and 64 // x", {"x": 0}, 0),
        ("min(x, 8, 3) + max(1, x) + abs(-2)", {"x": 5}, 10),
        ("ceil_div(x, 16)", {"x": 33}, 3),
        ("is_pow2(x) and not is_pow2(x + 1)", {"x": 64}, True),
        ("int(7 / 2) + int(b)", {"b": True}, 4),
        ("bool(x)", {"x": 0}, False),
        ("2 ** 64 - x", {"x": 0}, 2**64),  # the bound on every number is inclusive
        ("-(2 ** 64)", {}, -(2**64)),
    ],
)
def test_safe_eval_allowed(expr, env, expected):
    """Each allowed construct evaluates as Python would."""
    result = safe_eval(expr, env)
    assert result == expected and type(result) is type(expected)


@pytest.mark.parametrize(
    "expr, message",
    [
        ("__import__('os')", "may be called"),
        ("(1).real", "Attribute is not allowed"),
        ("x.__class__", "Attribute is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("[i for i in (1, 2)]", "ListComp is not allowed"),
        ("x[0]", "Subscript is not allowed"),
        ("(x := 1)", "NamedExpr is not allowed"),
        ("x in y", "tuple or list literal"),
        ("(1, 2)", "only allowed on the right side of `in`"),
        ("min(x)", "at least 2"),
        ("abs(x, y)", "takes 1 argument"),
        ("max(*x, 1)", "positional arguments only"),
        ("int(x=1)", "positional arguments only"),
        ("x is None", "comparison Is is not allowed"),
        ("~x", "operator Invert is not allowed"),
        ("x << 2", "operator LShift is not allowed"),
        ("None", "literal None is not allowed"),
        ("x +", "cannot parse"),
        ("x = 1", "cannot parse"),
        ("x * 1e30", "literal 1e+30 is larger than 2**64"),
        ("-" * 70 + "x", "nested more than 64 deep"),
        ("x + " * 300 + "x", "1201 characters long; at most 1000"),
    ],
)
def test_safe_eval_rejects(expr, message):
    """Constructs outside the subset are refused before anything is evaluated."""
    with pytest.raises(ExpressionError, match=re.escape(message)):
        safe_eval(expr, {"x": 1, "y": (1,)})


@pytest.mark.parametrize(
    "expr, env, message",
    [
        ("missing + 1", {}, "unknown name 'missing'"),
        ("1 // x", {"x": 0}, "division or modulo by zero"),
        ("2 ** x", {"x": 1000}, "exponent 1000 is larger than 64"),
        ("s * 100", {"s": "pad"}, "not a number"),
        ("int(s)", {"s": "pad"}, "invalid literal"),
        ("2 ** 64 + x", {"x": 1}, "18446744073709551616 + 1 is larger than 2**64 in magnitude"),
        ("x * 2.0 ** 64", {"x": 2}, "2 * 1.8446744073709552e+19 is larger than 2**64"),
        ("int(s)", {"s": "9" * 30}, "int('999999999999999999999999999999') is larger than 2**64"),
        ("max(x, 2) ** 64", {"x": 3}, "3 ** 64 is larger than 2**64"),
    ],
)
def test_safe_eval_runtime_errors(expr, env, message):
    """Failures while evaluating become ExpressionError, never a raw Python exception."""
    with pytest.raises(ExpressionError, match=re.escape(message)):
        safe_eval(expr, env)


# --------------------------------------------------------------------------- malformed files


def test_missing_file(tmp_path):
    """A missing file is reported as `<path>: no such file`, with no line."""
    path = tmp_path / "absent.yaml"
    with pytest.raises(UsageError) as info:
        load_space(path)
    assert str(info.value) == f"{path}: no such file"


HEAD = "family: t\nparams:\n  p:\n    values: [1, 2]\n"  # a valid 4-line start that cases extend

MALFORMED = [
    # (id, file text, line of the offending node, text the message contains)
    ("syntax", "family: t\nparams:\n  p: {values: [1, 2}\n", 3, "YAML error"),
    ("empty-file", "", 1, "empty file"),
    ("top-not-mapping", "# a list\n- family\n- params\n", 2, "top level must be a mapping"),
    ("missing-family", "# c\nparams:\n  p: {values: [1]}\n", 2, "missing top-level key 'family'"),
    ("missing-params", "family: t\n", 1, "missing top-level key 'params'"),
    ("unknown-top-key", HEAD + "parms: {}\n", 5, "unknown key 'parms' in the top level; allowed: family"),
    ("duplicate-top-key", HEAD + "family: u\n", 5, "duplicate key 'family' in the top level"),
    ("family-not-text", "family: 3\nparams:\n  p: {values: [1]}\n", 1, "family must be text"),
    ("description-not-text", HEAD + "description: [a]\n", 5, "description must be a single value"),
    ("params-empty", "family: t\nparams: {}\n", 2, "params is empty"),
    ("params-null", "family: t\nparams:\nderived: {}\n", 2, "params is empty"),
    ("params-not-mapping", "family: t\nparams: [p]\n", 2, "params must be a mapping"),
    ("param-not-mapping", "family: t\nparams:\n  p: [1, 2]\n", 3, "parameter 'p' must be a mapping"),
    ("param-missing-values", "family: t\nparams:\n  q: {values: [1]}\n  p:\n    doc: x\n", 4, "'p' has no `values`"),
    ("values-empty", "family: t\nparams:\n  p:\n    values: []\n", 4, "values of parameter 'p' is empty"),
    ("values-not-list", "family: t\nparams:\n  p:\n    values: 4\n", 4, "must be a list"),
    ("values-duplicate", "family: t\nparams:\n  p:\n    values:\n      - 1\n      - 2\n      - 1\n", 7, "duplicate value 1"),
    ("values-mixed", "family: t\nparams:\n  p:\n    values:\n      - 1\n      - a\n", 6, "mix int and str"),
    ("values-int-and-bool", "family: t\nparams:\n  p:\n    values:\n      - 1\n      - true\n", 6, "mix int and bool"),
    ("values-float", "family: t\nparams:\n  p:\n    values: [1.5]\n", 4, "integers, strings or booleans"),
    ("values-nested", "family: t\nparams:\n  p:\n    values:\n      - [1]\n", 5, "must be a single value"),
    ("values-unsafe-tag", "family: t\nparams:\n  p:\n    values:\n      - !!python/name:os.system ''\n", 5, "YAML error"),
    ("default-not-in-values", HEAD + "    default: 3\n", 5, "default 3 of parameter 'p' is not one of 1, 2"),
    ("default-bool-for-int", "family: t\nparams:\n  p:\n    values: [0, 1]\n    default: true\n", 5, "default True"),
    ("unknown-param-key", HEAD + "    valus: [1]\n", 5, "unknown key 'valus' in parameter 'p'; allowed: values, default, doc"),
    ("duplicate-param-key", HEAD + "    values: [3]\n", 5, "duplicate key 'values' in parameter 'p'"),
    ("duplicate-param", HEAD + "  p:\n    values: [3]\n", 5, "duplicate key 'p' in params"),
    ("param-bad-identifier", "family: t\nparams:\n  block-m: {values: [1]}\n", 3, "'block-m' is not a valid identifier"),
    ("param-keyword", "family: t\nparams:\n  if: {values: [1]}\n", 3, "'if' is not a valid identifier"),
    ("param-shadows-context", "family: t\nparams:\n  head_dim: {values: [1]}\n", 3, "shadows a context name"),
    ("param-shadows-function", "family: t\nparams:\n  max: {values: [1]}\n", 3, "shadows a function"),
    ("derived-not-mapping", HEAD + "derived: [x]\n", 5, "derived must be a mapping"),
    ("derived-does-not-parse", HEAD + "derived:\n  x: p +\n", 6, "cannot parse"),
    ("derived-disallowed", HEAD + "derived:\n  x: p.real\n", 6, "Attribute is not allowed"),
    ("derived-unknown-name", HEAD + "derived:\n  x: 2 * q\n", 6, "unknown name 'q'"),
    ("derived-uses-later-derived", HEAD + "derived:\n  x: y + 1\n  y: p\n", 6, "unknown name 'y'"),
    ("derived-shadows-param", HEAD + "derived:\n  p: 2\n", 6, "derived 'p' shadows a parameter"),
    ("derived-shadows-context", HEAD + "derived:\n  smem_limit: 2\n", 6, "shadows a context name"),
    ("derived-duplicate", HEAD + "derived:\n  x: p\n  x: 2\n", 7, "duplicate key 'x' in derived"),
    ("derived-empty-expression", HEAD + "derived:\n  x: ''\n", 6, "must be an expression"),
    ("constraints-not-list", HEAD + "constraints:\n  expr: p > 0\n", 6, "constraints must be a list"),
    ("constraint-not-mapping", HEAD + "constraints:\n  - p > 0\n", 6, "a constraint must be a mapping"),
    ("constraint-missing-why", HEAD + "constraints:\n  - expr: p > 0\n", 6, "constraint has no `why`"),
    ("constraint-missing-expr", HEAD + "constraints:\n  - why: because\n", 6, "constraint has no `expr`"),
    ("constraint-unknown-key", HEAD + "constraints:\n  - expr: p > 0\n    why: w\n    note: n\n", 8, "unknown key 'note'"),
    ("constraint-does-not-parse", HEAD + "constraints:\n  - why: w\n    expr: p >\n", 7, "cannot parse"),
    ("constraint-import", HEAD + "constraints:\n  - expr: \"__import__('os')\"\n    why: w\n", 6, "may be called"),
    ("constraint-lambda", HEAD + "constraints:\n  - expr: 'lambda: p'\n    why: w\n", 6, "Lambda is not allowed"),
    ("constraint-unknown-name", HEAD + "constraints:\n  - expr: p < block_q\n    why: w\n", 6, "unknown name 'block_q'"),
    ("constraint-why-not-text", HEAD + "constraints:\n  - expr: p > 0\n    why: [w]\n", 7, "why of a constraint must be a single value"),
]


@pytest.mark.parametrize("text, line, fragment", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_malformed_space(tmp_path, text, line, fragment):
    """A malformed space file raises one UsageError line `<path>:<line>: ...` pointing at the offending node."""
    path = write(tmp_path, text)
    with pytest.raises(UsageError) as info:
        load_space(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert fragment in message
    assert "\n" not in message


def test_optional_sections_may_be_empty(tmp_path):
    """A space with only family and params loads; bare `derived:` and `constraints:` mean none."""
    space = load_space(write(tmp_path, HEAD + "derived:\nconstraints: []\n"))
    assert space.description == "" and space.derived == () and space.constraints == ()
    assert space.params[0].default == 1 and space.params[0].doc == ""
    assert space.admitted_configs({}) == list(space.all_configs())


def test_runtime_error_names_file_and_line(tmp_path):
    """A derived value that divides by zero for some config fails with the file and line of its definition."""
    path = write(tmp_path, HEAD + "derived:\n  x: 64 // (p - 1)\nconstraints:\n  - {expr: x > 0, why: w}\n")
    space = load_space(path)
    assert space.admitted(space.config({"p": 2}), {})
    with pytest.raises(UsageError) as info:
        space.violations(space.config({"p": 1}), {})
    assert str(info.value).startswith(f"{path}:6: x: 64 // (p - 1): ")
    assert "by zero" in str(info.value)


def test_missing_context_name_at_runtime(tmp_path):
    """A constraint reading a context name that the caller did not supply fails with file and line."""
    path = write(tmp_path, HEAD + "constraints:\n  - expr: p <= head_dim\n    why: w\n")
    space = load_space(path)
    assert space.admitted(space.default_config(), {"head_dim": 64})
    with pytest.raises(UsageError, match=rf"^{path}:6: constraint: p <= head_dim: unknown name 'head_dim'$"):
        space.violations(space.default_config(), {})


# --------------------------------------------------------------------------- knobs a family declares


def attention_space(params: str) -> str:
    return "family: attention\nparams:\n" + params


def softmax_space(params: str) -> str:
    return "family: softmax\nparams:\n" + params


BAD_KNOBS = [
    # (id, file text, line of the offending node, texts the message contains)
    ("string-for-int", attention_space("  block_m:\n    values: ['64']\n"), 4,
     ("'64' is not a value of knob 'block_m' that the attention template accepts", "a multiple of 16 from 16 to 2048")),
    ("unknown-smem-layout", attention_space("  smem_layout:\n    values:\n      - swizzle\n      - banana\n"), 6,
     ("'banana' is not a value of knob 'smem_layout'", "one of plain, pad, swizzle")),
    ("bool-as-string", attention_space("  q_in_regs: {values: ['false']}\n"), 3, ("'false'", "one of true, false")),
    ("zero-tile", attention_space("  block_m: {values: [64, 0]}\n"), 3, ("0 is not a value of knob 'block_m'",)),
    ("too-many-stages", attention_space("  stages: {values: [9]}\n"), 3,
     ("9 is not a value of knob 'stages'", "an integer from 1 to 8")),
    ("unknown-knob", attention_space("  block_n: {values: [64]}\n  blok_m: {values: [64, 128]}\n"), 4,
     ("parameter 'blok_m' is not a knob of the attention family", "did you mean 'block_m'?")),
    ("unknown-knob-no-match", attention_space("  zzz: {values: [1]}\n"), 3, ("'zzz' is not a knob", "pingpong, persistent, pdl, epilogue, key_merge, kv_load, kv_cluster, exp2_fma, rescale, softmax_overlap, lean_addressing, p_operand, empty_warpgroups, causal_extent, stripe_order)")),
    ("softmax-vec", softmax_space("  vec: {values: [8, 3]}\n"), 3, ("3 is not a value of knob 'vec'", "one of 2, 4, 8")),
    ("softmax-strategy", softmax_space("  strategy: {values: [fast]}\n"), 3, ("one of cached, online, three_pass",)),
    ("softmax-typo", softmax_space("  thread_per_row: {values: [32]}\n"), 3, ("did you mean 'threads_per_row'?",)),
]


@pytest.mark.parametrize("text, line, fragments", [c[1:] for c in BAD_KNOBS], ids=[c[0] for c in BAD_KNOBS])
def test_knob_the_template_does_not_know(tmp_path, text, line, fragments):
    """A parameter the family's template does not read, or a value it does not accept, is one file:line UsageError (exit 2)."""
    path = write(tmp_path, text)
    with pytest.raises(UsageError) as info:
        load_space(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert all(f in message for f in fragments), message
    assert "\n" not in message and info.value.exit_code == 2


@pytest.mark.parametrize("module_name", ["attention", "softmax"])
def test_declared_knobs_are_the_template_knobs(module_name):
    """A built-in family declares exactly the knobs it has defaults for and its full space lists, each default allowed."""
    import importlib

    module = importlib.import_module(f"evotune.problems.{module_name}")
    domains = module.PROBLEM.knob_domains()
    assert set(domains) == set(module.KNOB_DEFAULTS)
    # test_template and test_softmax check that every knob of the full space changes the generated code.
    assert set(domains) == set(load_builtin(module.PROBLEM.default_space).param_names())
    for name, default in module.KNOB_DEFAULTS.items():
        domain = domains[name]
        if isinstance(domain, range):
            assert type(default) is int and default in domain, name
        else:
            assert any(type(v) is type(default) and v == default for v in domain), name


def test_knobs_checked_only_where_declared(tmp_path):
    """A plugin space is checked against the knob domains its caller passes, and not at all without them."""
    path = write(tmp_path, "family: mypkg.gemm:PROBLEM\nparams:\n  tile: {values: [64, 24]}\n  unroll: {values: [2]}\n")
    assert load_space(path).param_names() == ["tile", "unroll"]
    domains = {"tile": range(16, 257, 16), "unroll": (1, 2, 4)}
    with pytest.raises(UsageError, match=rf"^{re.escape(str(path))}:3: 24 is not a value of knob 'tile' that the "
                                         rf"mypkg\.gemm:PROBLEM template accepts: a multiple of 16 from 16 to 256$"):
        load_space(path, (), domains)
    assert load_space(path, (), {**domains, "tile": (64, 24)}).param_names() == ["tile", "unroll"]


# --------------------------------------------------------------------------- hostile files


HOSTILE = [
    ("python-object", "family: attention\nparams: !!python/object:os.system {}\n", 2,
     "YAML error: tag '!!python/object:os.system' is not allowed in a space file"),
    ("python-apply-top", "!!python/object/apply:os.system ['echo hi']\n", 1, "tag '!!python/object/apply:os.system'"),
    ("python-name-expr", HEAD + "constraints:\n  - expr: !!python/name:os.system p > 1\n    why: w\n", 6,
     "tag '!!python/name:os.system'"),
    ("python-tuple-values", "family: t\nparams:\n  p: {values: !!python/tuple [1]}\n", 3, "tag '!!python/tuple'"),
    ("python-key", "family: t\nparams:\n  !!python/str p: {values: [1]}\n", 3, "tag '!!python/str'"),
    ("binary", "family: t\nparams:\n  p: {values: [!!binary aGVsbG8=]}\n", 3, "tag '!!binary'"),
    ("set", "family: t\nparams:\n  p: {values: !!set {a: null}}\n", 3, "tag '!!set'"),
    ("local-tag", "family: t\nparams:\n  p: !include other.yaml\n", 3, "tag '!include'"),
    ("deep-yaml", "family: t\nparams:\n  p: {values: " + "[" * 40 + "]" * 40 + "}\n", 3, "nested more than 32 deep"),
    ("impossible-date", "family: t\nparams:\n  p:\n    values: [2024-13-45]\n", 4,
     "cannot read a value of parameter 'p' '2024-13-45'"),
    ("int-of-5000-digits", "family: t\nparams:\n  p:\n    values: [" + "9" * 5000 + "]\n", 4, "4300 digits"),
    ("int-beyond-2-64", "family: t\nparams:\n  p:\n    values: [1, " + str(2**70) + "]\n", 4,
     "a value of parameter 'p' is larger than 2**64 in magnitude"),
    ("long-expression", HEAD + "derived:\n  x: " + "+".join(["p"] * 600) + "\n", 6,
     "the expression is 1199 characters long; at most 1000"),
    ("deep-expression", HEAD + "derived:\n  x: " + "-" * 100 + "p\n", 6, "nested more than 64 deep"),
    ("deep-not", HEAD + "constraints:\n  - {expr: " + "not " * 200 + "p, why: w}\n", 6, "nested more than 64 deep"),
    ("huge-literal", HEAD + "derived:\n  x: p * 100000000000000000000000\n", 6,
     "literal 100000000000000000000000 is larger than 2**64"),
    ("huge-float-literal", HEAD + "derived:\n  x: p * 1e300\n", 6, "literal 1e+300 is larger than 2**64"),
]


@pytest.mark.parametrize("text, line, fragment", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_space_file(tmp_path, text, line, fragment):
    """Python tags, deep nesting, oversized numbers and oversized expressions are one file:line UsageError at load."""
    path = write(tmp_path, text)
    with pytest.raises(UsageError) as info:
        load_space(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert fragment in message and "\n" not in message and len(message) < 400
    assert info.value.exit_code == 2


def test_plain_yaml_tags_are_allowed(tmp_path):
    """Explicit tags of the plain types (`!!int`, `!!str`) still load."""
    space = load_space(write(tmp_path, "family: t\nparams:\n  p: {values: [!!int '16', 32]}\n  q: {values: [!!str 1]}\n"))
    assert space.params[0].values == (16, 32) and space.params[1].values == ("1",)


def test_oversized_file(tmp_path):
    """A space file over 1 MiB is refused before it is parsed."""
    path = write(tmp_path, HEAD + "#" * (1 << 20) + "\n")
    with pytest.raises(UsageError, match=rf"^{re.escape(str(path))}: \d+ bytes; a space file is at most 1048576 bytes$"):
        load_space(path)


@pytest.mark.parametrize("expr, values, message", [
    ("((p ** 64) ** 64) ** 64 > 1", "[9]", "9 ** 64 is larger than 2**64 in magnitude"),
    ("p * p * p * p * p > 1", "[65536]", "18446744073709551616 * 65536 is larger than 2**64 in magnitude"),
    ("(0 - p) ** 0.5 > 1", "[8]", "(-8) ** 0.5 is not a real number"),
    ("p / 1e-10 > 1", "[" + str(2**60) + "]", "1152921504606846976 / 1e-10 is larger than 2**64 in magnitude"),
])
def test_every_arithmetic_result_is_bounded(tmp_path, expr, values, message):
    """An expression whose value outgrows ±2**64 fails at its first such step, with the file, line and expression."""
    path = write(tmp_path, f"family: t\nparams:\n  p:\n    values: {values}\nconstraints:\n  - expr: {expr}\n    why: w\n")
    space = load_space(path)
    with pytest.raises(UsageError) as info:
        space.violations(space.default_config(), {})
    assert str(info.value) == f"{path}:6: constraint: {expr}: {message}"
    assert info.value.exit_code == 2
