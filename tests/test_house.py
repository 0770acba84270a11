"""The package's floors: every import inside evotune/ goes to its own floor or one below, and no function is long."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "evotune"

# Along the data flow, lowest first. A module imports from its own floor or lower ones, never higher:
# the library never reaches up into the CLI or the torch op, and space/ knows no family.
FLOORS = [
    {"evotune", "errors", "paths", "limits", "outputs", "timeline"},
    {"space"},
    {"build"},
    {"problems"},
    {"records"},
    {"gpu"},
    {"search"},
    {"cli", "torch", "__main__", "api", "testing"},
]
FLOOR_OF = {name: level for level, names in enumerate(FLOORS) for name in names}
LONGEST_FUNCTION = 80


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "evotune"


def _imported(path: Path):
    """(line, absolute module) for every evotune import in the file, including those inside functions."""
    module = _module(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "evotune":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "evotune":
                continue
            for alias in node.names:   # `from . import result` imports the module evotune.<room>.result
                sub = PACKAGE.parent / (target + "." + alias.name).replace(".", "/")
                yield node.lineno, (target + "." + alias.name
                                    if sub.with_suffix(".py").exists() or sub.is_dir() else target)


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_room_has_a_floor():
    """Each top-level module and subpackage of evotune/ is placed on a floor (a new room must be placed)."""
    rooms = {_room(_module(p)) for p in SOURCES}
    assert rooms - set(FLOOR_OF) == set()


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_runs_up_a_floor(path):
    """A module imports from its own floor or below."""
    here = FLOOR_OF[_room(_module(path))]
    upward = [f"line {line}: {target}" for line, target in _imported(path) if FLOOR_OF[_room(target)] > here]
    assert upward == []


def test_the_floor_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check above flags a relative import from the search floor in a space module."""
    fake = PACKAGE / "space" / "searchspace.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "from ..search.loop import SearchLoop\n")
    targets = [t for _, t in _imported(fake)]
    assert targets == ["evotune.search.loop"] and FLOOR_OF[_room(targets[0])] > FLOOR_OF["space"]


def test_no_function_is_long():
    """No function or method in evotune/ is longer than LONGEST_FUNCTION lines."""
    long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def _import_graph() -> dict[str, set[str]]:
    """module -> the evotune modules it imports (function-level imports included), packages as their __init__."""
    modules = {_module(p) for p in SOURCES}
    graph = {}
    for path in SOURCES:
        graph[_module(path)] = {t for _, t in _imported(path) if t in modules and t != _module(path)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`, each once, as the path that closes it."""
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_circle():
    """No evotune module reaches itself through imports, within a floor or across (a circle makes the import order
    matter and the floors meaningless); function-level imports count too."""
    assert _cycles(_import_graph()) == []


def test_the_circle_check_sees_a_circle():
    """The check above finds a circle of three modules and names its path."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
