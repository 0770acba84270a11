"""What the attention kernel can do, and the process-wide kernel cache: each (config, shape class)
is compiled once (compile.compile_source, itself cached on disk by source hash) and loaded once per
device (compile.load_kernel); launches go through the family's own launcher, on the current stream.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..errors import EvotuneError, UsageError
from ..problems import get_problem

PROBLEM = get_problem("attention")

FEATURES = ("gqa", "lse")
# Features the kernel lacks today, and why: the op routes such calls per its fallback policy, saying
# this. When kernels/attention.cu grows a feature, its entry goes (and the op's path for it with it).
# "gqa" (grouped-query attention) is supported: both variants read K/V head h // (heads / kv_heads) through
# the kv_group launch argument, never a per-query-head copy of K/V.
MISSING_FEATURES = {
    "lse": "the kernel does not write the row log-sum-exp, which a backward pass needs",
}


def supports(feature: str) -> bool:
    """Whether the attention kernel supports `feature` ("gqa", "lse")."""
    if feature not in FEATURES:
        raise UsageError(f"unknown kernel feature {feature!r}; features: {', '.join(FEATURES)}")
    return feature not in MISSING_FEATURES


def unsupported(feature: str) -> str:
    """Why the kernel does not support `feature` (empty where it does)."""
    return "" if supports(feature) else MISSING_FEATURES[feature]


def shape_class(shape) -> tuple:
    """What of an attention shape the compiled code depends on (AttentionProblem.template_args reads
    head_dim, dtype and causal; sizes, strides and the K/V group size are launch arguments)."""
    return shape.dtype, shape.head_dim, shape.causal


@dataclass(frozen=True)
class LoadedKernel:
    kernel: object            # CuPy RawKernel, bound to its device's context
    config: object            # evotune.space.Config
    device_index: int
    source_digest: str
    cubin_path: str


class KernelCache:
    """(config, shape class, device) -> LoadedKernel, filled once under a lock; reads take no lock.
    `loader(compiled, dynamic_smem, device_index)` loads a cubin on a device (injectable for tests)."""

    def __init__(self, loader=None):
        self._kernels: dict[tuple, LoadedKernel] = {}
        self._lock = threading.Lock()
        self._loader = loader or _load_on_device

    @staticmethod
    def key(config, shape, device_index: int) -> tuple:
        return (config.items,) + shape_class(shape) + (device_index,)

    def loaded(self, config, shape, device_index: int) -> LoadedKernel | None:
        return self._kernels.get(self.key(config, shape, device_index))

    def get(self, config, shape, device_index: int, expected_digest: str | None = None) -> LoadedKernel:
        """The loaded kernel, compiling and loading it on first use."""
        key = self.key(config, shape, device_index)
        found = self._kernels.get(key)
        if found is not None:
            return found
        with self._lock:
            if key not in self._kernels:
                source, compiled, geometry = compile_for(config, shape, expected_digest)
                kernel = self._loader(compiled, geometry.dynamic_smem, device_index)
                self._kernels[key] = LoadedKernel(kernel, config, device_index, source.digest, compiled.cubin_path)
            return self._kernels[key]

    def __len__(self) -> int:
        return len(self._kernels)

    def clear(self) -> None:
        with self._lock:
            self._kernels.clear()


def compile_for(config, shape, expected_digest: str | None = None):
    """(KernelSource, Compiled, LaunchGeometry) of `config` on `shape` (no GPU needed). EvotuneError where
    the source is not the one the table measured, or ptxas reports what the search's gate refuses."""
    from ..compile import compile_source, static_violations
    from ..template import instantiate

    source = instantiate(PROBLEM, config, shape)
    if expected_digest is not None and source.digest != expected_digest:
        raise EvotuneError(f"kernel source {source.digest} for {config.key()} is not the measured {expected_digest}: "
                           f"rebuild the tuning table")
    compiled = compile_source(source.code, source.entry)
    geometry = PROBLEM.geometry(config, shape)
    why = static_violations(compiled.resources, geometry.threads, geometry.dynamic_smem)
    if why:
        raise EvotuneError(f"config {config.key()} on {shape.spec}: {'; '.join(why)}")
    return source, compiled, geometry


def _load_on_device(compiled, dynamic_smem: int, device_index: int):
    import cupy

    from ..compile import load_kernel

    # CuPy loads a module into the current device's context: make it the call's device.
    with cupy.cuda.Device(device_index):
        return load_kernel(compiled, dynamic_smem)


def launch(loaded: LoadedKernel, shape, q, k, v, out, scale: float) -> None:
    """Run `loaded` on q, k, v into `out` on torch's current stream; the caller has made the tensors'
    device current (the family's launcher reads the stream at the launch, so graph capture and side
    streams see it)."""
    import cupy

    inputs = {"q": q, "k": k, "v": v, "scale": scale}
    with cupy.cuda.Device(loaded.device_index):
        PROBLEM.launcher(loaded.kernel, loaded.config, shape, inputs, out)()


CACHE = KernelCache()
