"""evotune's tuned attention kernel as a PyTorch op.

    import evotune.torch
    out = evotune.torch.attention(q, k, v, is_causal=True)     # SDPA's semantics
    out = evotune.torch.attention(q, k, v, softcap=50.0, window=(4095, 0))  # flash-attention's softcap and window
    out = evotune.torch.attention(q, k, v, is_causal=True, sinks=logits)  # attention sinks: (H,) logits (gpt-oss)
    print(evotune.torch.explain(q, k, v, is_causal=True))      # which kernel, and why
    evotune.torch.warmup()                                     # compile + load before graph capture

The op is `torch.ops.evotune.attention` (defined through torch.library.Library, its Python body registered
for every device, no mutated arguments, a fake implementation), so torch.compile(fullgraph=True)
traces it without a graph break and a compiled graph calls the body with no custom_op wrapper layers. It reads the
tuning table in $EVOTUNE_TABLE, else evotune.records.tuning_table.default_table_path(), or one given to
use_table(); evotune.records.tuning_table documents the table, its buckets and its selection rules, and
evotune.torch.routing the fallback policy. evotune.torch.launcher, the op's launches in C++, is built in the
background on the first kernel route (or by warmup()) and loaded on a later call: repeated calls then launch with no
Python route (EVOTUNE_CPP_LAUNCHER=0 turns it off).
"""

from .kernels import supports
from .op import Explanation, attention, attention_op, explain, warmup
from .record import ShapeRecorder, record_shapes
from .routing import EvotuneFallbackWarning, current_table, table_path, use_table

__all__ = ["attention", "attention_op", "explain", "Explanation", "warmup", "record_shapes", "ShapeRecorder",
           "use_table", "current_table", "table_path", "supports", "EvotuneFallbackWarning"]
