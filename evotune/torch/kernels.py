"""What the attention kernel can do, the process-wide kernel cache, and the op's launches: each (config,
shape class, write_lse) is compiled once (compile.compile_source, itself cached on disk by source hash) and
loaded once per device (compile.load_kernel); a launch goes through a PreparedLaunch (the family's entry
parameters in a reusable packet, evotune.gpu.packet) on torch's current stream.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..errors import EvotuneError, UsageError
from ..gpu import packet as _packet  # its launch_packet looked up per call (a test may stand in for it)
from ..problems import get_problem
from ..problems.attention import uses_tensor_maps
from .features import FEATURES, MISSING_FEATURES, supports, unsupported  # noqa: F401 (re-exported: evotune.torch.supports)

PROBLEM = get_problem("attention")
# What else holds loaded kernels and must let go when the cache is cleared (routing registers its fast routes):
# a callback, so this module needs no import of the modules above it in the torch room.
ON_CLEAR: list = []

def shape_class(shape) -> tuple:
    """What of an attention shape the compiled code depends on (AttentionProblem.template_args reads
    head_dim, dtype and causal, and whether there is a softcap, a window and sinks: the SOFTCAP, LOCAL and SINKS
    traits, which also add their entry parameters; V's own head dim, HEAD_DIM_V; sizes, strides, the K/V group size, the
    cap, the window's sides and the sink logits' pointer are launch arguments)."""
    return shape.dtype, shape.head_dim, shape.causal, shape.has_softcap, shape.has_window, shape.sinks, shape.head_dim_v


@dataclass(frozen=True)
class LoadedKernel:
    kernel: object            # CuPy RawKernel, bound to its device's context
    config: object            # evotune.space.searchspace.Config
    device_index: int
    source_digest: str        # of the searched kernel (what the table measured), also for a write_lse variant
    cubin_path: str
    write_lse: bool = False   # the variant that also writes the row log-sum-exp (training)

    @property
    def function(self) -> int:
        """The CUfunction handle, for cuLaunchKernel."""
        return self.kernel.kernel.ptr


class KernelCache:
    """(config, shape class, write_lse, device) -> LoadedKernel, filled once under a lock; reads take no
    lock. `loader(compiled, dynamic_smem, device_index)` loads a cubin on a device (injectable for tests)."""

    def __init__(self, loader=None):
        self._kernels: dict[tuple, LoadedKernel] = {}
        self._lock = threading.Lock()
        self._loader = loader or _load_on_device

    @staticmethod
    def key(config, shape, device_index: int, write_lse: bool = False) -> tuple:
        return (config.items,) + shape_class(shape) + (bool(write_lse), device_index)

    def loaded(self, config, shape, device_index: int, write_lse: bool = False) -> LoadedKernel | None:
        return self._kernels.get(self.key(config, shape, device_index, write_lse))

    def get(self, config, shape, device_index: int, expected_digest: str | None = None,
            write_lse: bool = False) -> LoadedKernel:
        """The loaded kernel, compiling and loading it on first use."""
        key = self.key(config, shape, device_index, write_lse)
        found = self._kernels.get(key)
        if found is not None:
            return found
        with self._lock:
            if key not in self._kernels:
                source, compiled, geometry = compile_for(config, shape, expected_digest, write_lse)
                kernel = self._loader(compiled, geometry.dynamic_smem, device_index)
                self._kernels[key] = LoadedKernel(kernel, config, device_index, source.digest, compiled.cubin_path,
                                                  write_lse)
            return self._kernels[key]

    def __len__(self) -> int:
        return len(self._kernels)

    def clear(self) -> None:
        with self._lock:
            self._kernels.clear()
        PREPARED.clear()
        for forget in ON_CLEAR:  # routing's fast routes: their closures hold loaded kernels
            forget()


def compile_for(config, shape, expected_digest: str | None = None, write_lse: bool = False):
    """(KernelSource, Compiled, LaunchGeometry) of `config` on `shape` (no GPU needed); with `write_lse`
    the variant that also writes the row log-sum-exp. EvotuneError where the searched kernel's source is not
    the one the table measured, or ptxas reports what the search's gate refuses. The KernelSource is the
    searched kernel's (its digest is the table's); the Compiled is the variant asked for."""
    from ..build.compile import compile_source, launch_violations
    from ..build.template import instantiate

    source = instantiate(PROBLEM, config, shape)
    if expected_digest is not None and source.digest != expected_digest:
        raise EvotuneError(f"kernel source {source.digest} for {config.key()} is not the measured {expected_digest}: "
                           f"rebuild the tuning table")
    built = instantiate(PROBLEM, config, shape, write_lse=True) if write_lse else source
    compiled = compile_source(built.code, built.entry)
    geometry = PROBLEM.geometry(config, shape)
    why = launch_violations(compiled.resources, geometry)
    if why:
        raise EvotuneError(f"config {config.key()} on {shape.spec}: {'; '.join(why)}")
    return source, compiled, geometry


def _load_on_device(compiled, dynamic_smem: int, device_index: int):
    import cupy

    from ..build.compile import load_kernel

    # CuPy loads a module into the current device's context: make it the call's device.
    with cupy.cuda.Device(device_index):
        return load_kernel(compiled, dynamic_smem)


def load_for(decision, write_lse: bool = False) -> LoadedKernel:
    """A routing decision's kernel (the write_lse variant for training), compiled and loaded on first use,
    never inside a CUDA graph capture (loading a module there would break it)."""
    config, index = decision.config, decision.call.device_index
    loaded = CACHE.loaded(config, decision.shape, index, write_lse)
    if loaded is not None:
        return loaded
    import torch

    if torch.cuda.is_current_stream_capturing():
        # Both variants capture (the Hopper one's tensor maps are kernel parameters); loading does not.
        first = "run the training step once" if write_lse else "call evotune.torch.warmup() (or the op once)"
        raise UsageError(f"evotune.torch.attention: cannot capture {decision.key.spec()} in a CUDA graph: its "
                         f"{'log-sum-exp ' if write_lse else ''}kernel is not loaded yet: {first} before capture")
    return CACHE.get(config, decision.shape, index, decision.entry.provenance["source_digest"], write_lse)


# --------------------------------------------------------------------------- launching


class PreparedLaunch:
    """A loaded kernel on one shape with one set of strides and scale, ready to launch again and again:
    grid, block and shared memory worked out once, and per thread a ParamPacket (evotune.gpu.packet) in which
    a call rewrites only the buffer addresses (and, for the Hopper variant or an mma.sync config with TMA loads,
    copies in the tensor maps of the new addresses, each encoded once per address) before cuLaunchKernel on torch's current stream
    (cuLaunchKernelEx with programmatic stream serialization for a pdl config: launch_packet). A sinks shape's packet
    ends with the sink logits' pointer, rewritten every call: the caller's (H,) float32 tensor may be a fresh
    conversion each time."""

    def __init__(self, loaded: LoadedKernel, shape, strides: tuple, scale: float, out_strides: tuple | None = None):
        plan = PROBLEM.launch_plan(loaded.config, shape)
        self.loaded, self.shape, self.scale = loaded, shape, scale
        self.grid, self.block, self.smem = plan.grid, plan.block, plan.dynamic_smem
        self.wgmma = plan.wgmma
        self.pdl = plan.pdl  # a pdl config's kernel goes out with programmatic stream serialization (cuLaunchKernelEx)
        # A split-KV workspace or a causal persistent grid's tile counters: fresh (zeroed) per call, since
        # calls on two streams may run at once.
        self.needs_workspace = bool(plan.workspace[2])
        # The shape's softcap and window (where it has them) add their run-time values last (SCORE_MOD_PARAMS), and
        # its sinks the logits' pointer after them (SINK_PARAMS).
        self.params = PROBLEM.entry_params(loaded.config, loaded.write_lse, shape)
        self.sinks = shape.sinks
        # (param, tensor index into (q, k, v, out), map args): the TMA-store epilogue maps the output too, laid out
        # as q unless told (the op allocates it like q).
        self.maps = ()
        if uses_tensor_maps(loaded.config):
            tensors = dict(zip("qkv", strides), o=tuple(out_strides or strides[0]))
            args = PROBLEM.tensor_map_args(loaded.config, shape, tensors)
            self.maps = tuple((f"{name}_map", "qkvo".index(name), a) for name, a in args.items())
        self._local = threading.local()
        self.function, self.device_index = loaded.function, loaded.device_index

    def __call__(self, q, k, v, out, lse=None, addresses=None, sinks=None) -> None:
        """Launch on q, k, v into out (and lse); `addresses`: q, k, v's data pointers where the caller has read them
        already (the op's route, for its alignment check: each read is a call into torch). `sinks`: a sinks shape's
        (H,) contiguous float32 sink logits on the tensors' device (kept alive by the caller until the launch is
        enqueued; the caching allocator orders its reuse on the stream)."""
        if self.sinks and sinks is None:
            raise EvotuneError(f"internal: the sinks kernel of {self.shape.spec} launched without its sink logits")
        workspace = PROBLEM.new_workspace(self.loaded.config, self.shape, out.device) if self.needs_workspace else ()
        packet = getattr(self._local, "packet", None)
        if packet is None:
            packet = self._local.packet = self._new_packet(q, k, v, out, lse, workspace, sinks)
        else:
            self._patch(packet, q, k, v, out, lse, workspace, addresses)
            if self.sinks:
                packet.sinks.value = sinks.data_ptr()
        _packet.launch_packet(self.function, self.grid, self.block, self.smem, current_stream_handle(self.device_index),
                              packet, self.pdl)

    def _new_packet(self, q, k, v, out, lse, workspace, sinks=None):
        from ..gpu.packet import ParamPacket

        values = PROBLEM.launch_values(self.loaded.config, self.shape, q, k, v, out, self.scale, lse, workspace,
                                       sinks)
        packet = ParamPacket(self.params, values)
        packet.sinks = packet.slot("sinks") if self.sinks else None
        packet.addresses = {}  # per map parameter: the address its bytes were made for
        # The slots a call rewrites, looked up once (o; q, k, v where they are pointers, not tensor maps).
        packet.o = packet.slot("o")
        packet.qkv = () if self.wgmma else (packet.slot("q"), packet.slot("k"), packet.slot("v"))
        return packet

    def _patch(self, packet, q, k, v, out, lse, workspace, addresses=None) -> None:
        # Each address read once (q, k, v's by the caller where it passes them), for the slots and the maps alike.
        pointers = (addresses or (q.data_ptr(), k.data_ptr(), v.data_ptr())) + (out.data_ptr(),)
        packet.o.value = pointers[3]
        if lse is not None:
            packet.slot("lse").value = lse.data_ptr()
        if self.maps:
            from ..build.tma import map_param

            for name, index, args in self.maps:
                address = pointers[index]
                if packet.addresses.get(name) != address:
                    packet.set_map(name, map_param(address, args))
                    packet.addresses[name] = address
        if self.wgmma:
            if workspace:
                packet.slot("tile_counter").value = workspace[2].data_ptr()
            return
        sq, sk, sv = packet.qkv
        sq.value, sk.value, sv.value = pointers[0], pointers[1], pointers[2]
        for name, t in zip(("ws_o", "ws_lse", "ws_count"), workspace):
            packet.slot(name).value = t.data_ptr()


class _PreparedCache:
    """(loaded kernel, shape, strides, scale) -> PreparedLaunch."""

    def __init__(self):
        self._prepared: dict[tuple, PreparedLaunch] = {}

    def get(self, loaded: LoadedKernel, shape, q, k, v, out, scale: float) -> PreparedLaunch:
        strides = (q.stride(), k.stride(), v.stride())
        key = (id(loaded), shape, strides, out.stride(), scale)
        found = self._prepared.get(key)
        if found is None or found.loaded is not loaded:
            found = self._prepared[key] = PreparedLaunch(loaded, shape, strides, scale, out.stride())
        return found

    def clear(self) -> None:
        self._prepared.clear()


PREPARED = _PreparedCache()


def current_stream_handle(device_index: int) -> int:
    """torch's current stream on `device_index`, as a raw handle (what torch.cuda.current_stream().cuda_stream
    gives, without making a Stream object: the per-call cost the op keeps small)."""
    global _raw_stream
    if _raw_stream is None:  # resolved once: torch._C's raw getter (a C call) where torch has it
        import torch

        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
            (lambda index: torch.cuda.current_stream(index).cuda_stream)
    return _raw_stream(device_index)


_raw_stream = None


def launch(loaded: LoadedKernel, shape, q, k, v, out, scale: float, lse=None, sinks=None) -> None:
    """Run `loaded` on q, k, v into `out` (and `lse` for a write_lse kernel) on torch's current stream of
    the tensors' device, which the caller has made current; a sinks shape reads `sinks`, its (H,) contiguous float32
    sink logits."""
    if loaded.write_lse != (lse is not None):
        raise EvotuneError(f"internal: a {'write_lse' if loaded.write_lse else 'forward-only'} kernel launched "
                           f"{'without' if lse is None else 'with'} a log-sum-exp output")
    PREPARED.get(loaded, shape, q, k, v, out, scale)(q, k, v, out, lse, None, sinks)


CACHE = KernelCache()
