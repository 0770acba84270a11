"""tools/feature_bench.py on the CPU: the dense shape each feature is compared with, and bad input (the timing itself
needs a GPU: docs/data/coverage/sinks_gpu.sh runs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from feature_bench import dense_of  # noqa: E402

from evotune.problems.shapes import parse_shape  # noqa: E402


@pytest.mark.parametrize("text, dense", [
    ("1,64,4096,64:bf16:kv8:causal:sinks", "1,64,4096,64:bf16:causal:kv8"),
    ("1,64,4096,64:bf16:kv8:window=127,0:sinks", "1,64,4096,64:bf16:causal:kv8"),  # a causal window: causal
    ("4,16,2048,64:window=256,256", "4,16,2048,64:fp16"),                          # two-sided: non-causal
    ("2,16,4096,128:bf16:kv8:causal:softcap=50", "2,16,4096,128:bf16:causal:kv8"),
    ("1,8,300,200,64:window=50,0", "1,8,300,200,64:fp16"),  # Sq != Sk: no causal (top-left would differ)
])
def test_dense_of_keeps_the_tensors_and_drops_the_features(text, dense):
    assert dense_of(parse_shape(text)) == parse_shape(dense)


def test_a_bad_case_is_one_line_and_exit_2():
    tool = Path(__file__).resolve().parents[1] / "tools" / "feature_bench.py"
    proc = subprocess.run([sys.executable, str(tool), "--case", "1,2,3"], capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
