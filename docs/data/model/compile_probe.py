"""What a torch.compile(fullgraph=True) call of SDPA and of evotune.torch.attention (tuned key, missing key) holds on
the GPU: run under TORCH_LOGS=output_code,guards, it logs each function's inductor wrapper code (the launches and
copies each call makes) and its guards (what dynamo checks before each call). docs/data/model/host3.sh runs it:

    TORCH_LOGS=output_code,guards python3 docs/data/model/compile_probe.py 1,12,512,64:causal > probe.log 2>&1
"""
import dataclasses
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import evotune.torch as et  # noqa: E402
from _tables import entry, table  # noqa: E402
from evotune.problems.shapes import parse_shape  # noqa: E402
from evotune.space.searchspace import load_builtin  # noqa: E402

warnings.simplefilter("ignore")
shape = dataclasses.replace(parse_shape(sys.argv[1] if len(sys.argv) > 1 else "1,12,512,64:causal"), layout="bshd")
gpu = (torch.cuda.get_device_name(0), "%d.%d" % torch.cuda.get_device_capability(0))
tuned = table(entry(shape, load_builtin("attention-hopper").default_config().as_dict(), "attention-hopper", gpu=gpu))
q, k, v = (torch.randn(shape.batch, shape.seq_q, shape.heads, shape.head_dim, device="cuda", dtype=torch.float16)
           .transpose(1, 2) for _ in range(3))


def compile_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal) + 1


def compile_tuned(q, k, v):
    return et.attention(q, k, v, is_causal=shape.causal) + 1


def compile_fallback(q, k, v):
    return et.attention(q, k, v, is_causal=shape.causal) + 1


for name, tab, fn in (("compile_sdpa", None, compile_sdpa), ("compile_tuned", tuned, compile_tuned),
                      ("compile_fallback", table(), compile_fallback)):
    et.use_table(tab)
    print(f"=== {name}: route {et.explain(q, k, v, is_causal=shape.causal).route}", file=sys.stderr, flush=True)
    compiled = torch.compile(fn, fullgraph=True)
    for _ in range(3):
        out = compiled(q, k, v)
    torch.cuda.synchronize()
    print(f"=== {name}: done, max |out - sdpa + 1| "
          f"{(out - compile_sdpa(q, k, v)).abs().max().item():.3g}", file=sys.stderr, flush=True)
