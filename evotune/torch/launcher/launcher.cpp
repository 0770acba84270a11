// evotune's compiled launcher (issue 41 section 1): the CUDA kernel of evotune::attention in C++.
//
// Python registers, per call facts (sizes, strides, dtype, device, options), a kernel route: the CUfunction CuPy
// loaded, grid, block, dynamic shared memory, the entry's parameters as bytes with the slots a call rewrites (the
// buffer addresses, the workspace, the TMA maps' addresses), and the output's size and strides. A call whose facts
// hold a route allocates its output, writes the addresses into a copy of the packed parameters and calls
// cuLaunchKernel on torch's current stream: no Python. An SDPA route (a key the table lacks or routes to SDPA) is
// registered too: at::scaled_dot_product_attention, its result in the op's layout. Any other call (first of its
// facts, a view off a 16-byte boundary, another current device) goes to evotune::_attention_body, the Python body.
//
// The driver is reached through dlopen("libcuda.so.1"), so the library links against nothing CUDA at build time
// (it builds on a machine with torch's CPU wheel and no CUDA toolkit), and the current stream through c10's device
// guard interface (getStream, getStreamNativeHandle), which libtorch_cuda implements once loaded.
// The operators through their at::_ops entries (the *_ops.h headers, which Tensor.h's methods use already), not
// ATen/ops/<name>.h and the context headers those bring.
//
// The library is also a Python extension module (evotune_launcher.call): eager code calls a route straight from
// Python, without torch.ops' schema-driven argument parsing, which cost more than the whole launch (issue 41's host
// parity: op-dispatch read 21.4 us per call against SDPA's 19.0 on an H200 host). Python.h comes first, as it asks.
#include <Python.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_ops.h>
#include <ATen/ops/empty_strided_ops.h>
#include <ATen/ops/scaled_dot_product_attention_ops.h>
#include <ATen/ops/zeros_ops.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using CUresult = int;
using LaunchKernelFn = CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    void*, void**, void**);
using EncodeTiledFn = CUresult (*)(void*, int, uint32_t, void*, const uint64_t*, const uint64_t*, const uint32_t*,
                                   const uint32_t*, int, int, int, int);

// cuda.h enums the Python encoder uses too (evotune/build/tma.py): no interleave, 128-byte swizzle, 256-byte L2
// promotion, zero fill out of bounds.
constexpr int kInterleaveNone = 0, kSwizzle128B = 3, kL2Promotion256B = 3, kOobFillNone = 0;
constexpr size_t kMapBytes = 128;

struct Driver {
  LaunchKernelFn launch = nullptr;
  EncodeTiledFn encode = nullptr;
  std::string error;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      out.error = std::string("dlopen libcuda.so.1: ") + dlerror();
      return out;
    }
    out.launch = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
    out.encode = reinterpret_cast<EncodeTiledFn>(dlsym(lib, "cuTensorMapEncodeTiled"));
    if (!out.launch) out.error = "libcuda.so.1 has no cuLaunchKernel";
    return out;
  }();
  return d;
}

// One TMA map parameter: which tensor (0 q, 1 k, 2 v, 3 out) it describes and how (tma.TiledMapArgs).
struct MapSpec {
  int64_t param = 0, tensor = 0, dtype = 0;
  std::array<uint64_t, 4> dims{};
  std::array<uint64_t, 3> strides{};
  std::array<uint32_t, 4> box{};
};

// A map encoded for one address, remembered: a caching allocator hands the same addresses back call after call.
struct MapMemo {
  uint64_t address = 0;
  alignas(64) std::array<unsigned char, kMapBytes> bytes{};
};

struct Route {
  bool sdpa = false;                    // an SDPA route: only out_size and out_stride are read
  void* function = nullptr;
  std::array<unsigned, 3> grid{}, block{};
  unsigned smem = 0;
  int64_t device = 0;
  std::vector<unsigned char> init;      // every parameter's bytes, each at its offset
  std::vector<int64_t> offsets;         // parameter i's offset in `init`
  // parameter index per rewritten address, -1 where the entry has none:
  // q, k, v, o, tile_counter, ws_o, ws_lse, ws_count
  std::array<int64_t, 8> slots{};
  std::vector<MapSpec> maps;
  std::array<int64_t, 4> out_size{}, out_stride{};
  std::array<int64_t, 3> workspace{};   // (ws_o floats, ws_lse floats, counters): the counters zeroed per call
  mutable std::mutex memo_lock;
  mutable std::vector<MapMemo> memos;   // one per map
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const noexcept {
    size_t h = 1469598103934665603ull;
    for (int64_t x : key) h = (h ^ static_cast<size_t>(x)) * 1099511628211ull;
    return h;
  }
};

std::shared_mutex routes_lock;
std::unordered_map<std::vector<int64_t>, std::shared_ptr<const Route>, KeyHash> routes;
std::atomic<int64_t> launches{0}, misses{0}, sdpa_calls{0}, direct_calls{0};

int64_t fallback_code(c10::string_view fallback) {
  if (fallback == "sdpa") return 0;
  if (fallback == "error") return 1;
  return -1;
}

int64_t double_bits(double x) {
  int64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

// The route's key: what evotune/torch/launcher/__init__.py's call_key spells in the same order.
std::vector<int64_t> call_key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                              std::optional<double> scale, bool enable_gqa, int64_t fallback) {
  std::vector<int64_t> key;
  key.reserve(40);
  for (const at::Tensor* t : {&q, &k, &v}) {
    auto sizes = t->sizes();
    key.insert(key.end(), sizes.begin(), sizes.end());
  }
  for (const at::Tensor* t : {&q, &k, &v}) {
    auto strides = t->strides();
    key.insert(key.end(), strides.begin(), strides.end());
  }
  // Each tensor's dtype and device: a call of the same sizes with another K or V dtype or device (which the op's full
  // path refuses) must not take a route made for a uniform call.
  for (const at::Tensor* t : {&q, &k, &v}) {
    key.push_back(static_cast<int64_t>(t->scalar_type()));
    key.push_back(static_cast<int64_t>(t->device().type()) * 65536 + t->device().index());
  }
  key.push_back(is_causal);
  key.push_back(enable_gqa);
  key.push_back(scale.has_value());
  key.push_back(scale.has_value() ? double_bits(*scale) : 0);
  key.push_back(fallback);
  return key;
}

std::shared_ptr<const Route> find_route(const std::vector<int64_t>& key) {
  std::shared_lock<std::shared_mutex> lock(routes_lock);
  auto it = routes.find(key);
  return it == routes.end() ? nullptr : it->second;
}

at::Tensor python_body(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                       std::optional<double> scale, bool enable_gqa, c10::string_view fallback, double softcap,
                       int64_t window_left, int64_t window_right, const std::optional<at::Tensor>& sinks) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("evotune::_attention_body", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
                                         std::optional<double>, bool, c10::string_view, double, int64_t, int64_t,
                                         const std::optional<at::Tensor>&)>();
  misses.fetch_add(1, std::memory_order_relaxed);
  return op.call(q, k, v, is_causal, scale, enable_gqa, fallback, softcap, window_left, window_right, sinks);
}

void encode_map(const Route& route, size_t i, uint64_t address, unsigned char* dst) {
  const MapSpec& spec = route.maps[i];
  std::lock_guard<std::mutex> lock(route.memo_lock);
  MapMemo& memo = route.memos[i];
  if (memo.address != address) {
    const Driver& d = driver();
    TORCH_CHECK(d.encode, "evotune launcher: libcuda.so.1 has no cuTensorMapEncodeTiled");
    alignas(128) std::array<unsigned char, kMapBytes> bytes{};
    std::array<uint32_t, 4> elem_strides{1, 1, 1, 1};
    CUresult rc = d.encode(bytes.data(), static_cast<int>(spec.dtype), 4, reinterpret_cast<void*>(address),
                           spec.dims.data(), spec.strides.data(), spec.box.data(), elem_strides.data(),
                           kInterleaveNone, kSwizzle128B, kL2Promotion256B, kOobFillNone);
    TORCH_CHECK(rc == 0, "evotune launcher: cuTensorMapEncodeTiled failed with CUresult ", rc);
    std::memcpy(memo.bytes.data(), bytes.data(), kMapBytes);
    memo.address = address;
  }
  std::memcpy(dst, memo.bytes.data(), kMapBytes);
}

at::Tensor new_tensor(c10::IntArrayRef size, c10::IntArrayRef stride, const at::Tensor& like, at::ScalarType dtype) {
  return at::_ops::empty_strided::call(c10::fromIntArrayRefUnchecked(size), c10::fromIntArrayRefUnchecked(stride), dtype,
                                       like.layout(), like.device(), std::nullopt);
}

at::Tensor launch(const Route& route, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const Driver& d = driver();
  TORCH_CHECK(d.launch, "evotune launcher: ", d.error);
  at::Tensor out = new_tensor(route.out_size, route.out_stride, q, q.scalar_type());
  at::Tensor ws_o, ws_lse, ws_count;
  if (route.workspace[2]) {  // fresh per call: calls on two streams may run the same route at once
    const int64_t one = 1;
    ws_o = new_tensor(c10::IntArrayRef(&route.workspace[0], 1), c10::IntArrayRef(&one, 1), q, at::kFloat);
    ws_lse = new_tensor(c10::IntArrayRef(&route.workspace[1], 1), c10::IntArrayRef(&one, 1), q, at::kFloat);
    ws_count = at::_ops::zeros::call(c10::fromIntArrayRefUnchecked(c10::IntArrayRef(&route.workspace[2], 1)), at::kInt,
                                     q.layout(), q.device(), std::nullopt);
  }
  alignas(128) unsigned char buffer[4096];
  TORCH_CHECK(route.init.size() <= sizeof buffer, "evotune launcher: parameters over 4 KiB");
  std::memcpy(buffer, route.init.data(), route.init.size());
  const std::array<uint64_t, 8> addresses{
      reinterpret_cast<uint64_t>(q.data_ptr()),     reinterpret_cast<uint64_t>(k.data_ptr()),
      reinterpret_cast<uint64_t>(v.data_ptr()),     reinterpret_cast<uint64_t>(out.data_ptr()),
      route.workspace[2] ? reinterpret_cast<uint64_t>(ws_count.data_ptr()) : 0,
      route.workspace[2] ? reinterpret_cast<uint64_t>(ws_o.data_ptr()) : 0,
      route.workspace[2] ? reinterpret_cast<uint64_t>(ws_lse.data_ptr()) : 0,
      route.workspace[2] ? reinterpret_cast<uint64_t>(ws_count.data_ptr()) : 0};
  for (size_t s = 0; s < addresses.size(); ++s) {
    if (route.slots[s] >= 0) std::memcpy(buffer + route.offsets[route.slots[s]], &addresses[s], sizeof(uint64_t));
  }
  for (size_t i = 0; i < route.maps.size(); ++i) {
    encode_map(route, i, addresses[route.maps[i].tensor], buffer + route.offsets[route.maps[i].param]);
  }
  void* params[512];
  const size_t n = route.offsets.size();
  TORCH_CHECK(n <= 512, "evotune launcher: over 512 parameters");
  for (size_t i = 0; i < n; ++i) params[i] = buffer + route.offsets[i];
  const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(route.device));
  const auto* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  void* stream = cuda->getStreamNativeHandle(cuda->getStream(device));  // torch's current stream, a cudaStream_t
  CUresult rc = d.launch(route.function, route.grid[0], route.grid[1], route.grid[2], route.block[0], route.block[1],
                         route.block[2], route.smem, stream, params, nullptr);
  TORCH_CHECK(rc == 0, "evotune launcher: cuLaunchKernel failed with CUresult ", rc);
  launches.fetch_add(1, std::memory_order_relaxed);
  return out;
}

// SDPA itself, its result copied into the op's layout only where its backend chose another (op._sdpa_route's rule).
at::Tensor run_sdpa(const Route& route, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                    std::optional<double> scale, bool enable_gqa) {
  at::Tensor o = at::_ops::scaled_dot_product_attention::call(q, k, v, std::nullopt, 0.0, is_causal, scale, enable_gqa);
  sdpa_calls.fetch_add(1, std::memory_order_relaxed);
  if (o.strides() == c10::IntArrayRef(route.out_stride)) return o;
  at::Tensor out = new_tensor(route.out_size, route.out_stride, q, q.scalar_type());
  out.copy_(o);
  return out;
}

// evotune::attention's CUDA kernel: the registered route where the call's facts have one, else the Python body.
// A call with a softcap, a window or sink logits goes to the Python body unread: the routes here are keyed without
// them (Python registers none for such calls), and their packets would need the score mods' values and the logits'
// pointer; Python runs them.
at::Tensor attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                          std::optional<double> scale, bool enable_gqa, c10::string_view fallback, double softcap,
                          int64_t window_left, int64_t window_right, const std::optional<at::Tensor>& sinks) {
  const bool mods = softcap != 0.0 || window_left != -1 || window_right != -1 || sinks.has_value();
  int64_t code = mods ? -1 : fallback_code(fallback);
  if (code >= 0) {
    auto route = find_route(call_key(q, k, v, is_causal, scale, enable_gqa, code));
    // Our kernel reads 16-byte rows; SDPA does not check alignment and its cuDNN backend gets such views wrong
    // (call.aligned_for_sdpa): a view off a boundary goes back to Python on either route.
    const uint64_t misaligned = (reinterpret_cast<uint64_t>(q.data_ptr()) | reinterpret_cast<uint64_t>(k.data_ptr()) |
                                 reinterpret_cast<uint64_t>(v.data_ptr())) & 15;
    if (route && route->sdpa && !misaligned) return run_sdpa(*route, q, k, v, is_causal, scale, enable_gqa);
    if (route && !route->sdpa) {  // its module is loaded in one device's context
      const auto current = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
      if (!misaligned && current == route->device) return launch(*route, q, k, v);
    }
  }
  return python_body(q, k, v, is_causal, scale, enable_gqa, fallback, softcap, window_left, window_right, sinks);
}

template <size_t N, typename T>
std::array<T, N> fixed(c10::IntArrayRef xs, const char* what) {
  TORCH_CHECK(xs.size() == N, "evotune launcher: ", what, " takes ", N, " values, got ", xs.size());
  std::array<T, N> out{};
  for (size_t i = 0; i < N; ++i) out[i] = static_cast<T>(xs[i]);
  return out;
}

// Python's registration of one kernel route (evotune/torch/launcher/__init__.py: register spells the arguments).
void add_route(c10::IntArrayRef key, int64_t function, c10::IntArrayRef grid, c10::IntArrayRef block, int64_t smem,
               int64_t device, c10::IntArrayRef init, c10::IntArrayRef offsets, c10::IntArrayRef slots,
               c10::IntArrayRef maps, c10::IntArrayRef out_size, c10::IntArrayRef out_stride,
               c10::IntArrayRef workspace) {
  auto route = std::make_shared<Route>();
  route->function = reinterpret_cast<void*>(function);
  route->grid = fixed<3, unsigned>(grid, "grid");
  route->block = fixed<3, unsigned>(block, "block");
  route->smem = static_cast<unsigned>(smem);
  route->device = device;
  route->init.assign(init.begin(), init.end());
  route->offsets.assign(offsets.begin(), offsets.end());
  route->slots = fixed<8, int64_t>(slots, "slots");
  route->out_size = fixed<4, int64_t>(out_size, "out_size");
  route->out_stride = fixed<4, int64_t>(out_stride, "out_stride");
  route->workspace = fixed<3, int64_t>(workspace, "workspace");
  const auto bytes = static_cast<int64_t>(route->init.size());
  for (int64_t off : route->offsets) {  // every parameter is 4 bytes at least
    TORCH_CHECK(off >= 0 && off + 4 <= bytes, "evotune launcher: offset ", off, " outside the parameters");
  }
  for (int64_t s : route->slots) {  // an address slot takes 8
    TORCH_CHECK(s < static_cast<int64_t>(route->offsets.size()) && (s < 0 || route->offsets[s] + 8 <= bytes),
                "evotune launcher: address slot ", s, " out of range");
  }
  // maps: 14 values each: param, tensor, dtype, dims[4], strides[3], box[4]
  TORCH_CHECK(maps.size() % 14 == 0, "evotune launcher: maps take 14 values each");
  for (size_t i = 0; i < maps.size(); i += 14) {
    MapSpec spec;
    spec.param = maps[i];
    spec.tensor = maps[i + 1];
    spec.dtype = maps[i + 2];
    for (int j = 0; j < 4; ++j) spec.dims[j] = static_cast<uint64_t>(maps[i + 3 + j]);
    for (int j = 0; j < 3; ++j) spec.strides[j] = static_cast<uint64_t>(maps[i + 7 + j]);
    for (int j = 0; j < 4; ++j) spec.box[j] = static_cast<uint32_t>(maps[i + 10 + j]);
    TORCH_CHECK(spec.tensor >= 0 && spec.tensor < 4, "evotune launcher: map tensor ", spec.tensor);
    TORCH_CHECK(spec.param >= 0 && spec.param < static_cast<int64_t>(route->offsets.size()) &&
                    route->offsets[spec.param] + static_cast<int64_t>(kMapBytes) <= bytes,
                "evotune launcher: map parameter outside the parameters");
    route->maps.push_back(spec);
  }
  route->memos.resize(route->maps.size());
  std::unique_lock<std::shared_mutex> lock(routes_lock);
  routes[std::vector<int64_t>(key.begin(), key.end())] = std::move(route);
}

void add_sdpa_route(c10::IntArrayRef key, c10::IntArrayRef out_size, c10::IntArrayRef out_stride) {
  auto route = std::make_shared<Route>();
  route->sdpa = true;
  route->out_size = fixed<4, int64_t>(out_size, "out_size");
  route->out_stride = fixed<4, int64_t>(out_stride, "out_stride");
  std::unique_lock<std::shared_mutex> lock(routes_lock);
  routes[std::vector<int64_t>(key.begin(), key.end())] = std::move(route);
}

void clear_routes() {
  std::unique_lock<std::shared_mutex> lock(routes_lock);
  routes.clear();
}

std::vector<int64_t> counts() {
  std::shared_lock<std::shared_mutex> lock(routes_lock);
  return {static_cast<int64_t>(routes.size()), launches.load(), misses.load(), sdpa_calls.load(), direct_calls.load()};
}

// The key this library builds for a call (any device's tensors): tests compare it with Python's.
std::vector<int64_t> key_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                            std::optional<double> scale, bool enable_gqa, c10::string_view fallback) {
  return call_key(q, k, v, is_causal, scale, enable_gqa, fallback_code(fallback));
}

// ---------------------------------------------------------------------------------------------------------------
// evotune_launcher.call(q, k, v, is_causal, scale, enable_gqa, fallback): the output of the call's registered route,
// or None where the call is not one a route may serve here (then the op's Python path runs it, as before): tensors
// that are not plain torch.Tensor, options of other types than the schema's, a torch-function or dispatch mode
// active, a tensor needing grad under grad mode, no route for the facts, a view off a 16-byte boundary, another
// current device. The checks are attention()'s fast path's own (evotune/torch/op.py), made here in C.
PyObject* py_call(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 7) {
    PyErr_SetString(PyExc_TypeError, "evotune_launcher.call takes q, k, v, is_causal, scale, enable_gqa, fallback");
    return nullptr;
  }
  if (!THPVariable_CheckExact(args[0]) || !THPVariable_CheckExact(args[1]) || !THPVariable_CheckExact(args[2]))
    Py_RETURN_NONE;
  PyObject *causal = args[3], *scale_obj = args[4], *gqa = args[5], *fb = args[6];
  if ((causal != Py_True && causal != Py_False) || (gqa != Py_True && gqa != Py_False)) Py_RETURN_NONE;
  std::optional<double> scale;
  if (scale_obj != Py_None) {
    if (!PyFloat_CheckExact(scale_obj)) Py_RETURN_NONE;
    scale = PyFloat_AS_DOUBLE(scale_obj);
  }
  if (!PyUnicode_Check(fb)) Py_RETURN_NONE;
  int64_t code = PyUnicode_CompareWithASCIIString(fb, "sdpa") == 0    ? 0
                 : PyUnicode_CompareWithASCIIString(fb, "error") == 0 ? 1
                                                                      : -1;
  if (code < 0) Py_RETURN_NONE;
  const at::Tensor& q = THPVariable_Unpack(args[0]);
  const at::Tensor& k = THPVariable_Unpack(args[1]);
  const at::Tensor& v = THPVariable_Unpack(args[2]);
  if (!q.is_cuda() || at::impl::torch_function_mode_enabled() || c10::impl::TorchDispatchModeTLS::stack_len() > 0)
    Py_RETURN_NONE;
  if ((q.requires_grad() || k.requires_grad() || v.requires_grad()) && c10::GradMode::is_enabled()) Py_RETURN_NONE;
  const bool is_causal = causal == Py_True, enable_gqa = gqa == Py_True;
  auto route = find_route(call_key(q, k, v, is_causal, scale, enable_gqa, code));
  const uint64_t misaligned = (reinterpret_cast<uint64_t>(q.data_ptr()) | reinterpret_cast<uint64_t>(k.data_ptr()) |
                               reinterpret_cast<uint64_t>(v.data_ptr())) & 15;
  if (!route || misaligned) Py_RETURN_NONE;
  try {
    at::Tensor out;
    if (route->sdpa) {
      out = run_sdpa(*route, q, k, v, is_causal, scale, enable_gqa);
    } else {
      if (c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index() != route->device) Py_RETURN_NONE;
      out = launch(*route, q, k, v);
    }
    direct_calls.fetch_add(1, std::memory_order_relaxed);
    return THPVariable_Wrap(std::move(out));
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef module_methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_call)), METH_FASTCALL,
     "call(q, k, v, is_causal, scale, enable_gqa, fallback): the registered route's output, or None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "evotune_launcher",
                          "evotune's compiled launcher (evotune/torch/launcher): the op's routes from C++", -1,
                          module_methods};

}  // namespace

// Importing the library as a module runs its static registrations (the operators below) and gives Python `call`.
PyMODINIT_FUNC PyInit_evotune_launcher() { return PyModule_Create(&module_def); }

TORCH_LIBRARY(evotune_launcher, m) {
  m.def("add_route(int[] key, int function, int[] grid, int[] block, int smem, int device, int[] init, "
        "int[] offsets, int[] slots, int[] maps, int[] out_size, int[] out_stride, int[] workspace) -> ()",
        &add_route);
  m.def("add_sdpa_route(int[] key, int[] out_size, int[] out_stride) -> ()", &add_sdpa_route);
  m.def("clear_routes() -> ()", &clear_routes);
  m.def("counts() -> int[]", &counts);
  m.def("key_of(Tensor q, Tensor k, Tensor v, bool is_causal, float? scale, bool enable_gqa, str fallback) -> int[]",
        &key_of);
}

TORCH_LIBRARY_IMPL(evotune, CUDA, m) {
  m.impl("attention", &attention_cuda);
}
