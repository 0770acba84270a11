"""The small family file (y = 2x over N elements) that tests/test_generic.py and tests/test_generic_source.py
write beside their kernels: one text, so the two stay the same family."""

FAMILY = """\
kernel: k.cu
entry: twice
shape: N=64:fp16
inputs: {x: {shape: [N]}}
outputs: {y: {shape: [N]}}
args: [x, y, N]
template: [ctype, threads]
launch: {grid: ["ceil_div(N, threads)"], block: [threads]}
tolerance: {atol: 0.001, rtol: 0.001}
reference: ref.py:ref
space:
  params:
    threads: {values: [32, 64]}
"""
