"""Tests for space files that extend another (`extends`, `pin`, `omit`), and for evotune.space.searchspace staying below the
families."""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from evotune.errors import UsageError
from evotune.problems.shapes import parse_shape
from evotune.space.reader import PROFILE_SEP, builtin_names
from evotune.space.searchspace import load_builtin, load_space

from _paths import REPO_ROOT

# --------------------------------------------------------------------------- the shipped spaces, as they loaded
# Recorded from the three built-in attention spaces before attention-hopper.yaml and attention-small.yaml were
# rewritten to extend attention.yaml: (name, values, default) of each knob, the derived names, the variant knob,
# and per shape the number of admitted configs with a digest of each one's key and derived values in order.
RECORDED = {
    "attention-hopper": {
        "params": [["mma", ["wgmma"], "wgmma"], ["block_m", [64, 128], 128], ["block_n", [32, 64, 128], 128],
                   ["compute_warps", [4, 8], 8], ["producer_warps", [0, 4], 4], ["stages", [1, 2, 3, 4], 2],
                   ["q_in_regs", [True, False], False], ["pingpong", [False, True], False]],
        "derived": ["smem_bytes", "acc_regs"],
        "variant": None,
        "admitted": {"mission": [126, "5256d502b2a7ae53"], "4,32,4096,128:causal": [114, "39c5f2e111b331e7"]},
    },
    "attention-small": {
        "params": [["block_m", [32, 64, 128], 64], ["block_n", [32, 64, 128], 64], ["compute_warps", [2, 4, 8], 4],
                   ["producer_warps", [0, 2], 0], ["stages", [2, 3, 4], 2], ["smem_layout", ["swizzle", "pad"], "swizzle"],
                   ["q_in_regs", [True], True], ["kv_splits", [1], 1], ["warp_key_groups", [1, 2, 4], 1]],
        "derived": ["threads", "row_groups", "rows_per_warp", "row_bytes", "smem_bytes", "acc_regs"],
        "variant": None,
        "admitted": {"mission": [456, "c97dad85b15e771f"], "4,32,4096,128:causal": [286, "a18810b625f44672"]},
    },
}


def admitted_digest(space, context, derived_names) -> list:
    """[count, digest] of the configs `space` admits under `context` in enumeration order, with their `derived_names`."""
    digest, count = hashlib.sha256(), 0
    for cfg in space.admitted_configs(context):
        env = space.derive(cfg, context)
        digest.update(json.dumps([cfg.key(), [env[name] for name in derived_names]]).encode() + b"\n")
        count += 1
    return [count, digest.hexdigest()[:16]]


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_extending_spaces_load_as_they_did(name, attention):
    """attention-hopper and attention-small, now extending attention.yaml, have the knobs, values, defaults and
    variant they had, derive the same values, and admit the same configs in the same order on two shapes."""
    space, recorded = load_builtin(name), RECORDED[name]
    assert [[p.name, list(p.values), p.default] for p in space.params] == recorded["params"]
    assert space.variant == recorded["variant"]
    # Inheriting attention.yaml's derived values adds names (threads, row_groups, ...); the old ones are all there.
    assert set(recorded["derived"]) <= {n for n, _, _ in space.derived}
    for text, expected in recorded["admitted"].items():
        assert admitted_digest(space, attention.context(parse_shape(text)), recorded["derived"]) == expected, text


def test_omitted_knobs_are_the_template_defaults(attention):
    """A shipped space's expressions read its omitted knobs as the values the template takes for a knob a config
    leaves out."""
    from evotune.problems.attention import KNOB_DEFAULTS

    full = {p.name for p in load_builtin("attention").params}
    context = attention.context(parse_shape("mission"))
    for name in RECORDED:
        space = load_builtin(name)
        omitted = full - set(space.param_names())
        env = space.derive(space.default_config(), context)
        assert omitted and all(env[knob] == KNOB_DEFAULTS[knob] for knob in omitted), name


def test_profiles_keep_what_each_was_for():
    """attention.yaml's profiles keep the header comment of the file each was: what it is for."""
    import re

    text = (REPO_ROOT / "search_spaces" / "attention.yaml").read_text()
    profiles = text.split("\nprofiles:\n", 1)[1]
    blocks = dict(re.findall(r"(?m)^  ([a-z0-9-]+):\n((?:(?:    .*)?\n)*)", profiles))
    for name, phrase in (("hopper", "Hopper variant"), ("small", "search efficiency")):
        assert phrase in blocks[name], name


def test_the_old_file_names_are_the_profiles(attention):
    """`attention:hopper3-mirror`, the bare name `attention-hopper3-mirror` and the path of the file it was (as a
    run's meta.json recorded it) all load the profile; the path a profile records is `attention.yaml#hopper3-mirror`."""
    from evotune.space.searchspace import load_space, resolve_space

    by_name = load_builtin("attention:hopper3-mirror")
    assert by_name.path.endswith(f"attention.yaml{PROFILE_SEP}hopper3-mirror")
    old_path = load_space(REPO_ROOT / "search_spaces" / "attention-hopper3-mirror.yaml")
    legacy = load_builtin("attention-hopper3-mirror")
    for space in (old_path, legacy, load_space(resolve_space("attention-hopper3-mirror")),
                  load_space(resolve_space("attention:hopper3-mirror"))):
        assert [(p.name, p.values) for p in space.params] == [(p.name, p.values) for p in by_name.params]
    assert "attention:hopper3-mirror" in builtin_names() and "attention:small" in builtin_names()


# --------------------------------------------------------------------------- profiles on small files

ROOT_WITH_PROFILES = """
family: t
params:
  p:
    values: [1, 2, 4]
    default: 2
  q:
    values: [true, false]
  r:
    values: [a, b]
constraints:
  - expr: p < 4 or q
    why: four only with q
profiles:
  ponly:
    description: searches p alone
    params:
      p: {}
  narrow:
    params:
      p:
        values: [1, 4]
        default: 4
    pin:
      r: b
    constraints:
      - expr: p == 1 or q
        why: the profile's own rule
"""


def test_a_profile_searches_what_it_names_and_leaves_the_rest_at_its_default(tmp_path):
    """A profile's configs hold the knobs it names (its values) and pins; every other knob is left out, read by the
    expressions as the root's default; the root's constraints apply, and the profile's own."""
    from evotune.space.searchspace import load_space

    root = tmp_path / "t.yaml"
    root.write_text(ROOT_WITH_PROFILES)
    full = load_space(root, ())
    assert [p.name for p in full.params] == ["p", "q", "r"]
    ponly = load_space(f"{root}{PROFILE_SEP}ponly", ())
    assert [p.name for p in ponly.params] == ["p"] and ponly.description == "searches p alone"
    assert [c.key() for c in ponly.admitted_configs({})] == ["p=1", "p=2", "p=4"]  # q's default true admits p=4
    narrow = load_space(f"{root}{PROFILE_SEP}narrow", ())
    assert [(p.name, p.values, p.default) for p in narrow.params] == [("p", (1, 4), 4), ("r", ("b",), "b")]
    assert [c.key() for c in narrow.admitted_configs({})] == ["p=1,r=b", "p=4,r=b"]
    assert [c.why for c in narrow.constraints] == ["four only with q", "the profile's own rule"]


def test_a_knob_added_to_the_root_reaches_no_profile_that_does_not_name_it(tmp_path):
    """Adding a knob edits the root only: each profile's configs stay as they were."""
    from evotune.space.searchspace import load_space

    root = tmp_path / "t.yaml"
    root.write_text(ROOT_WITH_PROFILES)
    before = [c.key() for c in load_space(f"{root}{PROFILE_SEP}narrow", ()).admitted_configs({})]
    root.write_text(ROOT_WITH_PROFILES.replace("constraints:\n  - expr: p < 4", "  s:\n    values: [0, 1]\n"
                                                "constraints:\n  - expr: p < 4", 1))
    assert [p.name for p in load_space(root, ()).params] == ["p", "q", "r", "s"]
    assert [c.key() for c in load_space(f"{root}{PROFILE_SEP}narrow", ()).admitted_configs({})] == before


@pytest.mark.parametrize("text, fragments", [
    (ROOT_WITH_PROFILES + "  empty: {}\n", ["profile 'empty' names no knob"]),
    (ROOT_WITH_PROFILES + "  bad:\n    omit: [p]\n", ["unknown key 'omit' in profile 'bad'"]),
    (ROOT_WITH_PROFILES + "  typo:\n    params:\n      pp: {}\n", ["'pp'"]),
])
def test_bad_profile_is_one_line_naming_it(tmp_path, text, fragments):
    """A profile with nothing to search, a key profiles do not take, or a knob the root lacks: one line naming it."""
    from evotune.space.searchspace import load_space

    root = tmp_path / "t.yaml"
    root.write_text(text)
    name = {"empty": "empty", "bad": "bad", "typo": "typo"}[[k for k in ("empty", "bad", "typo") if f"  {k}:" in text][0]]
    with pytest.raises(UsageError) as info:
        load_space(f"{root}{PROFILE_SEP}{name}", ())
    assert all(f in str(info.value) for f in fragments), str(info.value)
    root.write_text(ROOT_WITH_PROFILES)
    with pytest.raises(UsageError, match="no profile 'nosuch'; its profiles: ponly, narrow"):
        load_space(f"{root}{PROFILE_SEP}nosuch", ())


def test_profiles_only_in_a_root(tmp_path):
    """A file that extends another cannot declare profiles."""
    from evotune.space.searchspace import load_space

    child = tmp_path / "c.yaml"
    child.write_text("family: attention\nextends: attention\nprofiles:\n  x:\n    params:\n      stages: {}\n")
    with pytest.raises(UsageError, match="only a root space"):
        load_space(child)


# --------------------------------------------------------------------------- extends, pin and omit on small files

PARENT = """
# the space the tests extend
family: t
description: the parent
variant: kind
params:
  kind:
    values: [a, b]
    doc: which kind
  p:
    values: [1, 2, 4]
    default: 2
    doc: the p knob
  q:
    values: [true, false]
derived:
  twice: 2 * p
  more: twice + 1
constraints:
  - expr: kind == 'a' or p > 1
    why: b needs p above 1
"""


@pytest.fixture
def spaces(tmp_path, monkeypatch):
    """A folder of built-in spaces holding `parent.yaml`; returns a function writing `<name>.yaml` into it."""
    folder = tmp_path / "spaces"
    folder.mkdir()
    monkeypatch.setenv("EVOTUNE_SPACES", str(folder))

    def write(name: str, text: str) -> Path:
        path = folder / f"{name}.yaml"
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    write("parent", PARENT)
    return write


def test_child_overrides_adds_and_appends(spaces):
    """A partial override keeps the parent's doc; new knobs and derived values come last; an overriding derived
    value keeps its place; constraints are the parent's then the child's; description replaces."""
    child = load_space(spaces("child", """
        family: t
        extends: parent
        description: the child
        params:
          p:
            values: [4, 1]
            default: 4
          r:
            values: [0, 1]
        derived:
          twice: p + p
          extra: more + r
        constraints:
          - expr: r <= p
            why: r at most p
        """))
    assert [p.name for p in child.params] == ["kind", "p", "q", "r"]
    p = child.params[1]
    assert (p.values, p.default, p.doc, p.line) == ((4, 1), 4, "the p knob", 5)
    assert [(n, e) for n, e, _ in child.derived] == [("twice", "p + p"), ("more", "twice + 1"), ("extra", "more + r")]
    assert [c.why for c in child.constraints] == ["b needs p above 1", "r at most p"]
    assert child.description == "the child" and child.variant == "kind"
    assert child.derive(child.config({"p": 1, "r": 1}), {})["extra"] == 4


def test_child_keeps_what_it_does_not_mention(spaces):
    """A child with only `extends` and `family` is the parent under another path; a param override with neither
    values nor default keeps the parent's default, and narrowing values keeps it where it is still allowed."""
    parent = load_builtin("parent")
    child = load_space(spaces("child", "family: t\nextends: parent\n"))
    assert (child.params, child.derived, child.constraints, child.description, child.variant) == \
        (parent.params, parent.derived, parent.constraints, parent.description, parent.variant)
    narrowed = load_space(spaces("narrow", "family: t\nextends: parent\nparams:\n  p: {values: [2, 4]}\n"))
    assert narrowed.params[1].default == 2


def test_pin_and_omit(spaces):
    """`pin` leaves a knob one value (in the configs); `omit` takes it out of the configs, making it a derived
    constant (first, the parent's default) that expressions read; a variant knob left one value or none is no variant."""
    child = load_space(spaces("child", """
        family: t
        extends: parent
        pin: {kind: b}
        omit: [q]
        """))
    assert [(p.name, p.values, p.default) for p in child.params] == [("kind", ("b",), "b"), ("p", (1, 2, 4), 2)]
    assert child.params[0].doc == "which kind" and child.variant is None
    assert [(n, e) for n, e, _ in child.derived] == [("q", "True"), ("twice", "2 * p"), ("more", "twice + 1")]
    assert [c["p"] for c in child.admitted_configs({})] == [2, 4]
    assert child.default_config().keys() == ["kind", "p"]
    with pytest.raises(UsageError, match="unknown parameter 'q'"):
        child.config({"q": False})
    grandchild = load_space(spaces("grandchild", "family: t\nextends: child\nderived:\n  flag: q and p > 1\n"))
    assert grandchild.derive(grandchild.default_config(), {})["flag"] is True


def test_extends_a_builtin_space_from_any_folder(tmp_path):
    """`extends` names a built-in space wherever the extending file lies."""
    path = tmp_path / "mine.yaml"
    path.write_text("family: attention\nextends: attention-small\npin: {block_m: 64}\n")
    space = load_space(path)
    assert space.params[0].values == (64,) and space.path == str(path)


def test_runtime_error_names_the_file_that_states_it(spaces):
    """An inherited expression that fails when evaluated is reported at its own file and line."""
    spaces("parent", "family: t\nparams:\n  p: {values: [0, 1]}\nderived:\n  x: 4 // p\n")
    child_path = spaces("child", "family: t\nextends: parent\nconstraints:\n  - {expr: x > 0, why: w}\n")
    child = load_space(child_path)
    with pytest.raises(UsageError) as info:
        child.violations(child.config({"p": 0}), {})
    assert str(info.value).startswith(f"{child_path.parent / 'parent.yaml'}:5: x: 4 // p: ")


CHILD = "family: t\nextends: parent\n"  # a valid 2-line start that the bad cases extend

BAD_CHILDREN = [
    # (id, file text, line of the offending node, texts the message contains)
    ("missing-parent", "family: t\nextends: nosuch\n", 2, ["extends 'nosuch'", "no such built-in space", "parent"]),
    ("parent-as-path", "family: t\nextends: ../parent.yaml\n", 2, ["extends '../parent.yaml'", "built-in space name"]),
    ("extends-not-text", "family: t\nextends: [parent]\n", 2, ["extends must be a single value"]),
    ("other-family", "family: u\nextends: parent\n", 1, ["family 'u'", "extends", "'t'"]),
    ("override-bad-default", CHILD + "params:\n  p: {values: [1, 4]}\n", 4, ["default 2", "parent.yaml", "give a default"]),
    ("override-default-not-in-values", CHILD + "params:\n  p:\n    default: 3\n", 5, ["default 3", "not one of 1, 2, 4"]),
    ("new-param-without-values", CHILD + "params:\n  r: {doc: x}\n", 4, ["'r' has no `values`"]),
    ("new-param-shadows-derived", CHILD + "params:\n  twice: {values: [1]}\n", 4, ["'twice' shadows a derived name"]),
    ("override-reads-later-derived", CHILD + "derived:\n  twice: more\n", 4, ["unknown name 'more'"]),
    ("pin-unknown-knob", CHILD + "pin:\n  p: 2\n  pp: 1\n", 5, ["pin 'pp'", "no parameter 'pp'", "kind, p, q"]),
    ("pin-value-not-allowed", CHILD + "pin:\n  p: 3\n", 4, ["pin 'p'", "3 is not one of", "1, 2, 4"]),
    ("pin-value-wrong-type", CHILD + "pin:\n  q: 1\n", 4, ["pin 'q'", "1 is not one of", "True, False"]),
    ("pin-and-override", CHILD + "params:\n  p: {doc: other}\npin:\n  p: 1\n", 6, ["pin 'p'", "also under params"]),
    ("pin-not-mapping", CHILD + "pin: [p]\n", 3, ["pin must be a mapping"]),
    ("pin-without-extends", "family: t\nparams:\n  p: {values: [1]}\npin: {p: 1}\n", 4, ["pin", "extends"]),
    ("omit-unknown-knob", CHILD + "omit: [q, r]\n", 3, ["omit 'r'", "no parameter 'r'"]),
    ("omit-and-pin", CHILD + "pin: {q: true}\nomit:\n  - q\n", 5, ["omit 'q'", "also pinned"]),
    ("omit-twice", CHILD + "omit:\n  - q\n  - q\n", 5, ["omit 'q'", "twice"]),
    ("omit-everything", CHILD + "omit: [kind, p, q]\n", 3, ["leaves no parameter"]),
    ("omit-not-list", CHILD + "omit: q\n", 3, ["omit must be a list"]),
    ("derived-shadows-omitted", CHILD + "omit: [q]\nderived:\n  q: 1\n", 5, ["'q' shadows an omitted parameter"]),
    ("param-brings-back-omitted", "family: t\nextends: omitting\nparams:\n  q: {values: [true]}\n", 4,
     ["'q' shadows a derived name"]),
]


@pytest.mark.parametrize("text, line, fragments", [case[1:] for case in BAD_CHILDREN], ids=[c[0] for c in BAD_CHILDREN])
def test_bad_extending_space(spaces, text, line, fragments):
    """A mistake in extends, pin or omit raises one UsageError line `<path>:<line>: ...` at the offending node."""
    spaces("omitting", CHILD + "omit: [q]\n")
    path = spaces("child", text)
    with pytest.raises(UsageError) as info:
        load_space(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: ") and "\n" not in message, message
    assert all(fragment in message for fragment in fragments), message


def test_extends_cycle_is_refused(spaces):
    """Spaces that extend each other in a ring fail with one line naming the files of the ring."""
    a = spaces("a", "family: t\nextends: b\n")
    b = spaces("b", "family: t\nextends: a\n")
    with pytest.raises(UsageError) as info:
        load_space(a)
    message = str(info.value)
    assert message.startswith(f"{b}:2: extends 'a' makes a cycle: ") and "\n" not in message
    assert message.endswith(f"{a} -> {b} -> {a}")
    selfish = spaces("self", "family: t\nextends: self\n")
    with pytest.raises(UsageError, match=r"self.yaml:2: extends 'self' makes a cycle: .*self.yaml -> .*self.yaml$"):
        load_space(selfish)


def test_a_mistake_in_the_parent_names_the_parent(spaces):
    """An error inside the extended file is reported at that file and line."""
    parent = spaces("parent", "family: t\nparams:\n  p: {values: []}\n")
    with pytest.raises(UsageError, match=rf"^{parent}:3: values of parameter 'p' is empty$"):
        load_space(spaces("child", CHILD))


# --------------------------------------------------------------------------- evotune.space.searchspace stays below the families


def _imported_modules(path: Path) -> list[str]:
    """Every module name `path` imports (relative ones with their leading dots), wherever the import statement is."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names += [base] + [base + ("" if base.endswith(".") else ".") + alias.name for alias in node.names]
    return names


@pytest.mark.parametrize("source", sorted((REPO_ROOT / "evotune" / "space").glob("*.py")), ids=lambda p: p.name)
def test_space_module_never_imports_the_families(source):
    """No module of evotune/space/ imports from evotune.problems, at the top or inside a function, nor via importlib."""
    imported = _imported_modules(source)
    assert not [m for m in imported if "problems" in m.split(".")], imported
    assert "import_module" not in source.read_text() and "__import__" not in source.read_text()


def test_space_loads_without_the_families():
    """In a fresh interpreter, a space loads given its context names and knob domains without evotune.problems."""
    code = textwrap.dedent(f"""
        import sys
        from evotune.space.searchspace import load_space
        names = ("batch", "heads", "kv_heads", "seq_q", "seq_k", "head_dim", "head_dim_v", "dtype", "dtype_bytes",
                 "causal", "softcap", "window", "sinks", "varlen")
        space = load_space({str(REPO_ROOT / "search_spaces" / "attention-small.yaml")!r}, names)
        assert len(space.params) == 9, space.params
        assert not [m for m in sys.modules if m.startswith("evotune.problems")], sorted(sys.modules)
        """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_registered_families_give_the_names_a_file_is_checked_against(tmp_path):
    """Loaded by path with no names given, a space is checked against its family's registered context names."""
    path = tmp_path / "s.yaml"
    path.write_text("family: softmax\nparams:\n  vec: {values: [4]}\nconstraints:\n  - {expr: vec <= head_dim, why: w}\n")
    with pytest.raises(UsageError, match=rf"^{path}:5: constraint: unknown name 'head_dim'"):
        load_space(path)
