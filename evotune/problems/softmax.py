"""The row softmax family: kernels/softmax.cu against torch.softmax.

y[r, :] = softmax(x[r, :]) over the last dim of a contiguous [rows, cols] fp16 or bf16
tensor, fp32 math. The second family keeps the framework general: it shares the compile,
evaluate, search and runs code with attention and owns its shapes, like attention does.

A shape is written as a preset name or `ROWS,COLS` (or `ROWSxCOLS`), optionally followed by
`:fp16` or `:bf16`, e.g. `4096,1024:bf16` or `vocab-50k:bf16`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import UsageError
from ..limits import THREADS_PER_BLOCK, launch_asserts
from .shapes import parse_dim, parse_flags
from ..space.searchspace import DEVICE_CONTEXT_NAMES, device_context
from . import LaunchGeometry, Problem, knob_reader

DTYPES = ("fp16", "bf16")
STRATEGIES = {"cached": 0, "online": 1, "three_pass": 2}

# The value a knob takes when a (reduced) search space does not list it (online: right for any cols).
KNOB_DEFAULTS = {"threads_per_row": 128, "rows_per_cta": 1, "vec": 8, "strategy": "online", "unroll": 1}

# The values each knob may take: what SoftmaxTraits' static_asserts accept for it alone.
KNOB_DOMAINS = {
    "threads_per_row": tuple(2**i for i in range(THREADS_PER_BLOCK.bit_length())),  # powers of two up to 1024
    "rows_per_cta": range(1, THREADS_PER_BLOCK + 1),
    "vec": (2, 4, 8),
    "strategy": tuple(STRATEGIES),
    "unroll": range(1, 9),
}

CONTEXT_NAMES = ("rows", "cols", "dtype", "dtype_bytes") + DEVICE_CONTEXT_NAMES

# Correctness gate against torch.softmax in fp32: |y - ref| <= ATOL + RTOL*|ref|. The output is
# one fp32 value rounded to the output dtype, 2^-11 (fp16) or 2^-8 (bf16) of |ref| at most; exp2
# (2 ulp) and the fp32 sums add ~1e-6. ATOL covers fp16's subnormal outputs (spacing 6e-8).
# A kernel that drops or repeats one vector of a 1k-element row is off by ~1/1000 relative to
# every output of the row and by 100% on the vector itself.
TOLERANCE = {"fp16": (1e-6, 1e-3), "bf16": (1e-6, 8e-3)}  # (atol, rtol)


knob = knob_reader(KNOB_DEFAULTS)


@dataclass(frozen=True)
class SoftmaxShape:
    """One row-softmax problem: `rows` rows of `cols` elements, fp16 or bf16."""

    rows: int
    cols: int
    dtype: str = "fp16"

    def __post_init__(self) -> None:
        for name in ("rows", "cols"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"shape: {name} must be a positive integer, got {value!r}")
            if value >= 2**31:  # the kernel takes them as int
                raise UsageError(f"shape: {name} must be below 2^31, got {value}")
        if self.dtype not in DTYPES:
            raise UsageError(f"shape: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def spec(self) -> str:
        """The canonical `--shape` spelling."""
        return f"{self.rows},{self.cols}:{self.dtype}"

    @property
    def dtype_bytes(self) -> int:
        return 2

    def min_bytes(self) -> int:
        """Fewest bytes moved through device memory: x read once, y written once."""
        return 2 * self.rows * self.cols * self.dtype_bytes

    def as_dict(self) -> dict:
        return {"rows": self.rows, "cols": self.cols, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict) -> "SoftmaxShape":
        return cls(**{k: d[k] for k in ("rows", "cols", "dtype")})


PRESETS: dict[str, tuple[SoftmaxShape, str]] = {
    "softmax-1k": (SoftmaxShape(8192, 1024), "attention-score rows at S=1k: rows fit a warp's registers"),
    "softmax-4k": (SoftmaxShape(4096, 4096), "square 4k: rows of 8 KB"),
    "softmax-narrow": (SoftmaxShape(65536, 128), "many short rows: a few threads per row"),
    "vocab-50k": (SoftmaxShape(1024, 50257), "LM-head logits (GPT-2 vocabulary): long ragged rows"),
}

_DIMS = re.compile(r"^\s*(\d+)\s*[,x]\s*(\d+)\s*$")


def parse_shape(text: str) -> SoftmaxShape:
    """A preset name or `ROWS,COLS[:fp16|:bf16]` as a SoftmaxShape, or UsageError."""
    if text is None or not str(text).strip():
        raise UsageError("shape: empty; give a preset (see `evotune shapes --family softmax`) or ROWS,COLS")
    text = str(text).strip()
    dims_part, *flags = text.split(":")
    name = dims_part.strip()
    if name in PRESETS:
        rows, cols, dtype = PRESETS[name][0].rows, PRESETS[name][0].cols, PRESETS[name][0].dtype
    else:
        match = _DIMS.match(dims_part)
        if not match:
            if re.match(r"^[A-Za-z][\w-]*$", name):
                raise UsageError(f"shape: unknown preset {name!r}; presets: {', '.join(PRESETS)}")
            raise UsageError(f"shape: cannot read {text!r}; write ROWS,COLS with optional :fp16|:bf16")
        int32 = "the kernel indexes rows and columns with 32-bit ints"
        rows = parse_dim(match.group(1), "rows", 2**31 - 1, int32)
        cols = parse_dim(match.group(2), "cols", 2**31 - 1, int32)
        dtype = "fp16"
    return SoftmaxShape(rows, cols, parse_flags(flags, {d: "dtype" for d in DTYPES}, text).get("dtype", dtype))


class SoftmaxProblem(Problem):
    family = "softmax"
    kernel_file = "softmax.cu"
    entry_name = "evotune_softmax"
    default_space = "softmax"
    default_shape = "softmax-4k"
    title = "row softmax kernel"
    context_names = CONTEXT_NAMES
    perturbed = "element"
    baseline_kind = "torch"
    rate_unit = "GB/s"
    knob_abbrev = {"threads_per_row": "tpr", "rows_per_cta": "rows", "strategy": "", "unroll": "u"}
    # Rows only repeat the work: a tiling tuned for 4096 rows of 1024 is a good start for 16384 rows.
    size_fields = frozenset({"rows"})

    # ------------------------------------------------------------ shapes
    def parse_shape(self, text: str) -> SoftmaxShape:
        return parse_shape(text)

    def shape_from_dict(self, d: dict) -> SoftmaxShape:
        return SoftmaxShape.from_dict(d)

    def presets(self) -> dict:
        return dict(PRESETS)

    def shape_columns(self, shape: SoftmaxShape) -> dict:
        return {"rows": str(shape.rows), "cols": str(shape.cols), "dtype": shape.dtype}

    def describe_shape(self, shape: SoftmaxShape) -> str:
        return f"rows={shape.rows} cols={shape.cols}"

    def sanitize_shape(self, shape: SoftmaxShape) -> SoftmaxShape:
        """Few rows (a partial last CTA), the same cols: the cols decide the code path and the register cache."""
        return SoftmaxShape(rows=7, cols=shape.cols, dtype=shape.dtype)

    def check_shape(self, shape: SoftmaxShape) -> None:
        if not isinstance(shape, SoftmaxShape):
            raise UsageError(f"softmax: not a softmax shape: {shape!r}")

    def context(self, shape: SoftmaxShape) -> dict:
        return {"rows": shape.rows, "cols": shape.cols, "dtype": shape.dtype, "dtype_bytes": shape.dtype_bytes,
                **device_context()}

    def knob_domains(self) -> dict:
        return KNOB_DOMAINS

    def rate(self, shape: SoftmaxShape, time_us: float) -> float:
        return shape.min_bytes() / time_us / 1e3  # GB/s

    # ------------------------------------------------------------ code
    def cache_vecs(self, config, shape: SoftmaxShape) -> int:
        """Vectors a thread keeps in registers with the cached strategy (1, unused, otherwise). Only the
        cached strategy's code depends on the shape: other strategies are one kernel for every cols."""
        if knob(config, "strategy") != "cached":
            return 1
        return max(1, math.ceil((shape.cols // int(knob(config, "vec"))) / int(knob(config, "threads_per_row"))))

    def template_args(self, config, shape: SoftmaxShape) -> list[tuple[str, object]]:
        return [
            ("THREADS_PER_ROW", int(knob(config, "threads_per_row"))),
            ("ROWS_PER_CTA", int(knob(config, "rows_per_cta"))),
            ("VEC", int(knob(config, "vec"))),
            ("STRATEGY", STRATEGIES[knob(config, "strategy")]),
            ("UNROLL", int(knob(config, "unroll"))),
            ("CACHE_VECS", self.cache_vecs(config, shape)),
            ("IS_BF16", "true" if shape.dtype == "bf16" else "false"),
        ]

    def instantiation(self, config, shape: SoftmaxShape) -> str:
        targs = ",\n    ".join(f"/* {name} = */ {value}" for name, value in self.template_args(config, shape))
        geo = self.geometry(config, shape)
        asserts = launch_asserts(geo.threads, geo.dynamic_smem, ("kRowsPerCta", int(knob(config, "rows_per_cta"))))
        return f"""using EvotuneTraits = evotune::SoftmaxTraits<
    {targs}>;
{asserts}
// Launch: grid (ceil(rows / ROWS_PER_CTA)), block (EvotuneTraits::kThreads), no dynamic shared memory.
// x and y are fp16/bf16 bit patterns, 16-byte aligned, rows `row_stride` elements apart (both tensors).
// Launch bounds say one CTA per SM at least: with the thread bound alone, ptxas 13.0 capped streaming
// configs at 40 registers and spilled (three_pass, vec 4, unroll 4: 44 registers without the cap).
extern "C" __global__ void __launch_bounds__(EvotuneTraits::kThreads, 1)
{self.entry_name}(const unsigned short* __restrict__ x, unsigned short* __restrict__ y, int rows, int cols,
                long long row_stride) {{
    evotune::softmax_rows<EvotuneTraits>(x, y, rows, cols, row_stride);
}}
"""

    def geometry(self, config, shape: SoftmaxShape) -> LaunchGeometry:
        rows_per_cta = int(knob(config, "rows_per_cta"))
        threads = int(knob(config, "threads_per_row")) * rows_per_cta
        return LaunchGeometry(grid=(math.ceil(shape.rows / rows_per_cta), 1, 1), block=(threads, 1, 1),
                              dynamic_smem=0)

    def launch_notes(self, config, shape: SoftmaxShape) -> list[str]:
        """The cached strategy's register cache is sized for the shape's cols."""
        if knob(config, "strategy") != "cached":
            return ["cols         any (the row is streamed from memory)"]
        most = self.cache_vecs(config, shape) * int(knob(config, "threads_per_row")) * int(knob(config, "vec"))
        return [f"cols         at most {most}: the row is cached in registers sized for cols {shape.cols}"]

    def signature(self, config=None) -> str:
        return ("evotune_softmax(const unsigned short* x, unsigned short* y  /* fp16 or bf16 bit patterns */, "
                "int rows, int cols, int64 row_stride)  // row_stride in elements, the same for x and y")

    def tolerance(self, shape: SoftmaxShape) -> tuple[float, float]:
        return TOLERANCE[shape.dtype]

    # ------------------------------------------------------------ GPU side
    def torch_dtype(self, shape: SoftmaxShape):
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16}[shape.dtype]

    # Input patterns of the gate. "normal" is N(0,1); the others stress the max and the sum.
    PATTERNS = ("normal", "large", "very_negative", "equal", "dominant", "masked")

    def make_inputs(self, shape: SoftmaxShape, seed: int, device="cuda", pattern: str = "normal") -> dict:
        """A fresh x (never zeros); the output buffer comes from `new_output`.

        large:         x30 (|x| up to ~150: exp overflows fp32 unless the row max is subtracted)
        very_negative: x - 200 (exp underflows to 0 unless the row max is subtracted)
        equal:         every element of a row equal: uniform 1/cols
        dominant:      one element per row 20 above the rest: it takes almost all the mass
        masked:        about half the elements -inf (a masked score row), never a whole row
        """
        import torch

        if pattern not in self.PATTERNS:
            raise UsageError(f"softmax: unknown input pattern {pattern!r}; patterns: {', '.join(self.PATTERNS)}")
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        x = torch.randn(shape.rows, shape.cols, generator=gen, device=device)
        if pattern == "large":
            x = x * 30
        elif pattern == "very_negative":
            x = x - 200
        elif pattern == "equal":
            x = x[:, :1].expand_as(x).clone()
        elif pattern == "dominant":
            j = torch.randint(shape.cols, (shape.rows, 1), generator=gen, device=device)
            x.scatter_(1, j, 20.0)
        elif pattern == "masked":
            drop = torch.rand(shape.rows, shape.cols, generator=gen, device=device) < 0.5
            drop[:, torch.randint(shape.cols, (1,), generator=gen, device=device)] = False
            x = x.masked_fill(drop, float("-inf"))
        return {"x": x.to(self.torch_dtype(shape)).contiguous()}

    def perturb(self, shape: SoftmaxShape, inputs: dict, rng=None) -> tuple[dict, object]:
        """Inputs with one element raised by 2, and the (rows,) mask of rows that may change: that row, or none
        when rows have one element (softmax of one value is 1 whatever the value). The element is drawn from
        `rng` (a random.Random); without one, the middle of the middle row."""
        import torch

        if rng is None:
            r, c = shape.rows // 2, shape.cols // 2
        else:
            r, c = rng.randrange(shape.rows), rng.randrange(shape.cols)
        x = inputs["x"].clone()
        x[r, c] += 2.0
        may_change = torch.zeros(shape.rows, dtype=torch.bool, device=x.device)
        may_change[r] = shape.cols > 1
        return {**inputs, "x": x}, may_change

    def new_output(self, inputs: dict):
        import torch

        return torch.empty_like(inputs["x"])

    def launcher(self, kernel, config, shape: SoftmaxShape, inputs: dict, out):
        """A zero-argument callable that launches the kernel on torch's current stream."""
        import numpy as np

        from ..build.compile import torch_stream_launcher

        x = inputs["x"]
        geo = self.geometry(config, shape)
        for name, t in (("x", x), ("y", out)):
            if t.dim() != 2 or t.stride(-1) != 1 or t.data_ptr() % 16:
                raise UsageError(f"softmax: {name} must be 2-D with unit column stride and 16-byte aligned")
        if out.stride(0) != x.stride(0):
            raise UsageError("softmax: x and y must have the same row stride")
        args = (np.uint64(x.data_ptr()), np.uint64(out.data_ptr()), np.int32(shape.rows), np.int32(shape.cols),
                np.int64(x.stride(0)))
        return torch_stream_launcher(kernel, geo.grid, geo.block, args, geo.dynamic_smem)

    def reference(self, shape: SoftmaxShape, inputs: dict):
        """softmax over the last dim in fp32."""
        import torch

        return torch.softmax(inputs["x"].float(), dim=-1)

    def baselines(self) -> list[str]:
        return ["softmax"]

    def baseline_launcher(self, name: str, shape: SoftmaxShape, inputs: dict, probe: bool = True):
        """torch.softmax on the input dtype (fp32 math inside, as ours), returning its output."""
        import torch

        if name != "softmax":
            raise UsageError(f"softmax: unknown baseline {name!r}; baselines: {', '.join(self.baselines())}")
        x = inputs["x"]

        def run():
            return torch.softmax(x, dim=-1)

        return self.probed(run, probe)


PROBLEM = SoftmaxProblem()
