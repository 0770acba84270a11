"""The repository the tests run from. Tests read kernels/, search_spaces/ and tools/ here, not through
evotune's own REPO_ROOT, so the suite also runs against a wheel install of evotune (.ci/run does)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str):
    """tools/NAME.py as a module (the tools are scripts, not a package). Warnings stay as they were: a tool
    that silences them does so for its own process, not the suite's."""
    import importlib.util
    import warnings

    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        spec.loader.exec_module(module)
    return module
