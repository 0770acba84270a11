"""generate() through the transformers adapter with the decode table (run by docs/data/decode/run.sh after
op_check.py): a 2-layer Llama-like model (32/8 heads, d128, bf16, random weights) greedy-decodes 32 tokens after a
2000-token prompt with DynamicCache, once with attn_implementation="evotune" and once with "sdpa", alternating
3 rounds. Prints the decode steps' route, the agreement of the greedy tokens and of the first step's logits, and
the median generate() time of each. Writes generate_check.json.

    python3 docs/data/decode/generate_check.py TABLE_JSON OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch


def main(table_path: str, out_dir: str) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    from evotune.torch import decode as D
    from evotune.torch import hf

    D.use_decode_table(table_path)
    hf.register()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=4096, intermediate_size=2048, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (1, 2000), device="cuda")
    runs = {"evotune": [], "sdpa": []}
    outs = {}
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        for _ in range(3):
            for impl in runs:
                model.set_attn_implementation(impl)
                torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.no_grad():
                    outs[impl] = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                                output_logits=True, return_dict_in_generate=True)
                torch.cuda.synchronize()
                runs[impl].append(time.perf_counter() - start)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(1, 8, 2010, 128, device="cuda", dtype=torch.bfloat16)
    route = D.decode_route(q, cache, cache, False)
    same_tokens = (outs["evotune"].sequences == outs["sdpa"].sequences).float().mean().item()
    # The raw logits (output_logits), not the processed scores: min_new_tokens sets EOS's score to -inf in both, and
    # inf - inf would make the difference NaN.
    first_err = (outs["evotune"].logits[1].float() - outs["sdpa"].logits[1].float()).abs().max().item()
    scale = outs["sdpa"].logits[1].float().abs().max().item()
    row = {"route_at_2010_keys": route, "token_agreement": same_tokens, "step2_logits_max_abs_diff": first_err,
           "step2_logits_max_abs": scale, "generate_s": {k: statistics.median(v) for k, v in runs.items()},
           "rounds_s": runs, "adapter_stats": hf.stats(), "told": sorted({str(w.message)[:200] for w in told})}
    Path(out_dir, "generate_check.json").write_text(json.dumps(row, indent=1))
    print(f"generate 1x2000+32 bf16 Llama-like 2 layers: decode route {route[:60]}; tokens agree "
          f"{same_tokens:.3f}; step-2 logits diff {first_err:.3g} of {scale:.3g}; generate() "
          f"evotune {row['generate_s']['evotune'] * 1e3:.1f} ms vs sdpa {row['generate_s']['sdpa'] * 1e3:.1f} ms "
          f"(median of 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
