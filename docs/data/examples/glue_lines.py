"""The glue each example needs, counted the same way on both sides: lines that are neither blank nor only a comment
(docstrings count). evotune: the family file and its reference module (examples/E/E.yaml, examples/E/reference.py;
the .cu not counted). Kernel Tuner 1.5: the function compare.py tunes it with (kt_E: the __global__ wrapper, the
inputs, the answer, tune_params, restrictions, verify and the tune_kernel call), and kt_optin, which the GEMM needs
for its configs above 48 KB of shared memory.

    python3 docs/data/examples/glue_lines.py      # prints the table docs/PLUGINS.md holds (tests/test_examples_glue.py)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ("gemm", "rmsnorm")
# Family-file keys a user may leave out (docs/PLUGINS.md): what is left is the least a family file needs.
OPTIONAL_KEYS = ("dtypes", "presets", "flops", "bytes", "baselines", "perturb")


def code_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def function_lines(path: Path, name: str) -> int:
    text = path.read_text()
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return len(code_lines("\n".join(text.splitlines()[node.lineno - 1:node.end_lineno])))


def evotune_lines(example: str) -> dict:
    folder = ROOT / "examples" / example
    family = code_lines((folder / f"{example}.yaml").read_text())
    reference = folder / "reference.py"
    module = len(code_lines(reference.read_text()))
    baselines = [n.name for n in ast.parse(reference.read_text()).body
                 if isinstance(n, ast.FunctionDef) and n.name != "reference"]
    optional = sum(1 for line in family if line.split(":")[0].strip() in OPTIONAL_KEYS) \
        + sum(function_lines(reference, n) for n in baselines)
    return {"family": len(family), "reference": module, "total": len(family) + module,
            "least": len(family) + module - optional}


def kernel_tuner_lines(example: str) -> int:
    return function_lines(ROOT / "docs" / "data" / "examples" / "compare.py", f"kt_{example}")


def table() -> str:
    optin = function_lines(ROOT / "docs" / "data" / "examples" / "compare.py", "kt_optin")
    rows = ["| kernel | evotune (family file + reference.py) | evotune, optional keys left out | "
            "Kernel Tuner 1.5 (`kt_<kernel>` in docs/data/examples/compare.py) |",
            "|--------|------|------|------|"]
    for example in EXAMPLES:
        ev, kt = evotune_lines(example), kernel_tuner_lines(example)
        extra = f", + {optin} for shared memory above 48 KB (`kt_optin`)" if example == "gemm" else ""
        rows.append(f"| {example} | {ev['total']} ({ev['family']} + {ev['reference']}) | {ev['least']} | "
                    f"{kt}{extra} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
