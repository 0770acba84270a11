"""Record the attention keys a transformers model calls (the first step of the workflow: record, tune,
run), for the models of tools/model_bench.py:

    python tools/record_model_shapes.py --sizes gpt2:1x512 --out shapes.json
    evotune tune --shapes shapes.json --table table.json

Builds each model as model_bench does (random weights), runs one prefill with attn_implementation
"evotune" inside evotune.torch.record_shapes(), and saves the distinct keys.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import model_bench  # noqa: E402


def main(argv=None) -> int:
    import torch

    from evotune.torch import hf, record_shapes

    args = model_bench.parse_args(argv)
    out = args.out or "shapes.json"
    hf.register("evotune", assume_unpacked=True)
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    with record_shapes() as rec:
        for family, b, s in model_bench.parse_sizes(args.sizes):
            model, _ = model_bench.build_model(family, args, s, torch, dtype)
            model.set_attn_implementation("evotune")
            ids = torch.randint(0, model.config.vocab_size, (b, s), device=args.device)
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
            del model
    rec.save(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
