"""How many guards dynamo checks before each call of a torch.compile(fullgraph=True) function of one attention call:
F.scaled_dot_product_attention against evotune.torch.attention (a CPU call: the SDPA route, traced as SDPA itself).
Each guard is checked on every call of the compiled function; a guard a line of TORCH_LOGS=guards' tree ("+- KIND:").

    python docs/data/model/guards_probe.py        # prints: sdpa N, evotune M
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ONE = """
import sys, warnings, torch, torch.nn.functional as F
sys.path.insert(0, {root!r})
import evotune.torch as et
warnings.simplefilter("ignore")
q = torch.randn(1, 64, 2, 64).transpose(1, 2)
fn = (lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True) + 1) if sys.argv[1] == "sdpa" else (
    lambda q: et.attention(q, q, q, is_causal=True) + 1)
f = torch.compile(fn, fullgraph=True, backend="eager")
for _ in range(3):
    f(q)
"""


def count(which: str) -> int:
    env = {**os.environ, "TORCH_LOGS": "guards"}
    done = subprocess.run([sys.executable, "-c", ONE.format(root=str(ROOT)), which], capture_output=True, text=True,
                          env=env, timeout=300)
    return sum(1 for line in (done.stdout + done.stderr).splitlines() if "+- " in line and ":" in line.split("+- ")[1]
               and line.split("+- ")[1].split(":")[0].isupper())


if __name__ == "__main__":
    print(f"sdpa {count('sdpa')}, evotune {count('evotune')}")
