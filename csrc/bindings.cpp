// All Python bindings of the core live in this one file. They only convert arguments (numpy arrays
// through the buffer protocol, Python callables, DLPack capsules) and manage the GIL; the logic is in
// csrc/src.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>
#include <cstdint>
#include <cstdio>

#include "dpara_rt/build_info.h"
#include "dpara_rt/dlpack.h"
#include "dpara_rt/host_linear.h"
#include "dpara_rt/host_qwen3.h"
#include "dpara_rt/lane.h"
#include "dpara_rt/mailbox.h"
#include "dpara_rt/markov_head.h"
#include "dpara_rt/metrics.h"
#include "dpara_rt/ring.h"
#include "dpara_rt/round_state.h"
#include "dpara_rt/staging.h"
#include "dpara_rt/types.h"
#include "dpara_rt/verify.h"

namespace py = pybind11;
using namespace dpara_rt;

namespace {

using I64Array = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;

// Sizes arrive as Python objects so that a huge or mistyped value gets a ValueError naming it, not
// pybind11's signature dump.
std::int64_t int_arg(const py::handle& v, const char* name, std::int64_t lo, std::int64_t hi) {
  PyObject* index = py::isinstance<py::bool_>(v) ? nullptr : PyNumber_Index(v.ptr());  // int, numpy ints
  if (!index) {
    PyErr_Clear();
    throw py::value_error(std::string(name) + " = " + std::string(py::repr(v)) + "; expected an int");
  }
  const py::int_ big = py::reinterpret_steal<py::int_>(index);
  if (big < py::int_(lo) || big > py::int_(hi))
    throw py::value_error(std::string(name) + " = " + std::string(py::repr(big)) + " is out of range; expected " +
                          std::to_string(lo) + ".." + std::to_string(hi));
  return big.cast<std::int64_t>();
}

int as_int(const py::handle& v, const char* name) { return int(int_arg(v, name, INT32_MIN, INT32_MAX)); }

std::vector<std::int64_t> token_ids(const py::handle& ids, const char* name) {
  std::vector<std::int64_t> out;
  if (!py::isinstance<py::iterable>(ids) || py::isinstance<py::str>(ids))
    throw py::value_error(std::string(name) + " must be a list of int token ids, got " +
                          std::string(py::str(py::type::of(ids).attr("__name__"))));
  for (auto item : ids) {
    if (!py::isinstance<py::int_>(item) || py::isinstance<py::bool_>(item))
      throw py::value_error(std::string(name) + " holds " + std::string(py::repr(item)) + "; expected int token ids");
    out.push_back(item.cast<std::int64_t>());
  }
  return out;
}

// A Python tuple's spelling of a shape, "(2, 3)" or "(2,)" (no iostreams: see detail::append).
template <class It>
std::string tuple_str(It first, It last) {
  std::string out = "(";
  for (It it = first; it != last; ++it) out += (it == first ? "" : ", ") + std::to_string(*it);
  return out + (last - first == 1 ? ",)" : ")");
}

std::string shape_str(const py::array& a) { return tuple_str(a.shape(), a.shape() + a.ndim()); }

std::string dims_str(std::initializer_list<py::ssize_t> dims) { return tuple_str(dims.begin(), dims.end()); }

// Checks that `a` has exactly the shape `dims` and returns its data.
const std::int64_t* expect_shape(const I64Array& a, std::initializer_list<py::ssize_t> dims, const char* name) {
  bool ok = a.ndim() == py::ssize_t(dims.size());
  for (std::size_t i = 0; ok && i < dims.size(); ++i) ok = a.shape(py::ssize_t(i)) == dims.begin()[i];
  if (!ok) throw py::value_error(std::string(name) + " must have shape " + dims_str(dims) + ", got " + shape_str(a));
  return a.data();
}

I64Array new_array(std::initializer_list<py::ssize_t> dims) { return I64Array(std::vector<py::ssize_t>(dims)); }

// The data of a caller-owned output: a writable C-contiguous int64 numpy array of exactly `dims`.
std::int64_t* out_data(const py::object& given, std::initializer_list<py::ssize_t> dims, const char* name) {
  const bool is_array = py::isinstance<py::array>(given);
  auto a = is_array ? py::reinterpret_borrow<py::array>(given) : py::array();
  bool ok = is_array && py::array_t<std::int64_t, py::array::c_style>::check_(a) && a.writeable() &&
            a.ndim() == py::ssize_t(dims.size());
  for (std::size_t i = 0; ok && i < dims.size(); ++i) ok = a.shape(py::ssize_t(i)) == dims.begin()[i];
  if (!ok)  // the message is built only on failure: this check runs on the per-round path
    throw py::value_error(std::string(name) + " must be a writable contiguous int64 array of shape " +
                          dims_str(dims) + ", got " +
                          (is_array ? std::string(py::str(a.dtype())) + " " + shape_str(a)
                                    : std::string(py::str(py::type::of(given)))));
  return static_cast<std::int64_t*>(a.mutable_data());
}

// out_data for a [n] output, or a new array when `given` is None.
std::pair<py::object, std::int64_t*> out_array(const py::object& given, py::ssize_t n, const char* name) {
  if (given.is_none()) {
    auto a = new_array({n});
    std::int64_t* p = a.mutable_data();
    return {std::move(a), p};
  }
  return {given, out_data(given, {n}, name)};
}

I64Array per_request(const RoundState& s, std::int64_t (RoundState::*get)(int) const) {
  auto out = new_array({s.batch()});
  for (int b = 0; b < s.batch(); ++b) out.mutable_at(b) = (s.*get)(b);
  return out;
}

template <class T>
py::array_t<T> to_array(const std::vector<T>& v) {
  return py::array_t<T>(py::ssize_t(v.size()), v.data());
}

// --- Lanes -----------------------------------------------------------------------------------------
// A Python callable can be dropped on a lane's worker thread, which holds no GIL: take it for that.
struct PyCallable {
  py::object fn;
  ~PyCallable() {
    if (fn) {
      py::gil_scoped_acquire gil;
      fn = py::object();
    }
  }
};

Task python_task(py::function fn) {
  auto held = std::make_shared<PyCallable>();
  held->fn = std::move(fn);
  // The GIL is held only while Python runs, so torch ops on two lanes overlap (torch releases it inside).
  return [held] {
    py::gil_scoped_acquire gil;
    held->fn();
  };
}

// Lanes made from Python. At exit they are drained while the interpreter still runs, so a queued Python
// callable never tries to take the GIL of a finalizing interpreter.
std::mutex registry_mu;
std::vector<std::weak_ptr<Lane>>& lane_registry() {
  static auto* lanes = new std::vector<std::weak_ptr<Lane>>();  // leaked: outlives static destruction
  return *lanes;
}

template <class L>
std::shared_ptr<L> python_lane(L* raw) {
  // Destroying a lane joins its worker, which may need the GIL for a last Python callable.
  std::shared_ptr<L> lane(raw, [](L* p) {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      delete p;
    } else {
      delete p;
    }
  });
  std::lock_guard<std::mutex> lk(registry_mu);
  auto& reg = lane_registry();
  reg.erase(std::remove_if(reg.begin(), reg.end(), [](auto& w) { return w.expired(); }), reg.end());
  reg.push_back(lane);
  return lane;
}

constexpr double kExitDrainSeconds = 10.0;

void drain_lanes_at_exit() {
  std::vector<std::shared_ptr<Lane>> live;
  {
    std::lock_guard<std::mutex> lk(registry_mu);
    for (auto& w : lane_registry())
      if (auto l = w.lock()) live.push_back(std::move(l));
  }
  py::gil_scoped_release nogil;
  for (auto& l : live) {
    try {
      auto* host = dynamic_cast<HostLane*>(l.get());
      if (!host) {
        l->synchronize();
      } else if (!host->synchronize_for(kExitDrainSeconds)) {
        // A task that never finishes (it waits for something that will not happen) must not hang the exit:
        // say so, and keep the lane alive so that nothing joins its worker.
        std::fprintf(stderr, "dpara_rt: host lane '%s' is still busy %.0f s into interpreter exit; leaving it\n",
                     host->name().c_str(), kExitDrainSeconds);
        static auto* abandoned = new std::vector<std::shared_ptr<Lane>>();  // leaked on purpose
        abandoned->push_back(l);
      }
    } catch (...) {  // an uncollected task error has nobody left to report to
    }
  }
}

// --- DLPack ----------------------------------------------------------------------------------------
void dlpack_capsule_destructor(PyObject* capsule) {
  // A consumer renames the capsule to "used_dltensor" and takes over the deleter; otherwise it is ours.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* m = static_cast<dlpack::DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    m->deleter(m);
  }
}

py::object dlpack_capsule(const TensorView& v, const py::object& dl_device, const py::object& copy) {
  if (!copy.is_none() && copy.cast<bool>())
    throw py::buffer_error("copy=True is not supported: dpara_rt views are zero-copy");
  if (!dl_device.is_none()) {
    const auto want = dl_device.cast<std::pair<int, int>>();
    const auto have = dlpack_device(v);
    if (want.first != int(have.device_type) || want.second != have.device_id)
      throw py::buffer_error("dl_device (" + std::to_string(want.first) + ", " + std::to_string(want.second) +
                             ") differs from the view's device (" + std::to_string(int(have.device_type)) + ", " +
                             std::to_string(have.device_id) + ") and copies are not supported");
  }
  dlpack::DLManagedTensor* managed = to_dlpack(v);
  PyObject* cap = PyCapsule_New(managed, "dltensor", dlpack_capsule_destructor);
  if (!cap) {
    managed->deleter(managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(cap);
}

// Optional arguments arrive as py::object: a None for a `T*` parameter would make pybind11 resolve the
// call twice (about a microsecond), which matters on the per-round path.
template <class T>
T* optional_arg(const py::object& o) {
  return o.is_none() ? nullptr : o.cast<T*>();
}

Event optional_event(const py::object& o) { return o.is_none() ? Event() : o.cast<Event>(); }

// wait_on without holding the GIL when it has to block (the event may need a Python callable to run).
void wait_released(const Event& e, Lane* lane) {
  if (e.query()) return;
  py::gil_scoped_release nogil;
  wait_on(e, lane);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "dpara_rt scheduling core: lanes, events, boundary ring, staging, round state, metrics";

  m.def("build_info", [] {
    auto info = build_info();
    py::dict d;
    d["compiler"] = info.compiler;
    d["cuda_compiled"] = info.cuda_compiled;
    d["cuda_runtime_version"] = info.cuda_runtime_version;
    d["cuda_devices"] = info.cuda_devices;
    d["cuda_device_names"] = info.cuda_device_names;
    d["cuda_status"] = info.cuda_status;
    return d;
  });
  m.attr("MAX_DRAFT") = kMaxDraft;  // the draft limit of the whole runtime (types.h)
  m.attr("HOST_LINEAR_PANEL") = kHostLinearPanel;  // output columns per packed panel: host_linear column ranges
  m.def("now_ns", &now_ns, "Monotonic host clock (ns) shared by host events and the metrics timeline.");

  py::class_<Event>(m, "Event")
      .def(py::init<>(), "A null event: already complete.")
      .def("query", &Event::query, py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("timestamp_ns",
                             py::cpp_function(&Event::timestamp_ns, py::call_guard<py::gil_scoped_release>()))
      .def_property_readonly("device", &Event::device)
      .def_property_readonly("is_host", &Event::is_host)
      .def_static("elapsed_ms", &Event::elapsed_ms, py::arg("start"), py::arg("end"),
                  py::call_guard<py::gil_scoped_release>());

  py::class_<Lane, std::shared_ptr<Lane>>(m, "Lane")
      .def("submit", [](Lane& l, py::function fn) { l.submit(python_task(std::move(fn))); }, py::arg("fn"))
      .def("record", &Lane::record, py::call_guard<py::gil_scoped_release>())
      .def("wait", &Lane::wait, py::arg("event"), py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &Lane::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("copy_async", [](Lane& l, std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes) {
             l.copy_async(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
           }, py::arg("dst_ptr"), py::arg("src_ptr"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>(),
           "Copy nbytes from src_ptr to dst_ptr (host or device addresses) in lane order.")
      .def_property_readonly("device", &Lane::device)
      .def_property_readonly("stream", &Lane::stream)
      .def_property_readonly("name", &Lane::name);
  py::class_<HostLane, Lane, std::shared_ptr<HostLane>>(m, "HostLane")
      .def(py::init([](std::string name) { return python_lane(new HostLane(std::move(name))); }),
           py::arg("name") = "host")
      .def_property_readonly("pending", &HostLane::pending);
  py::class_<CudaLane, Lane, std::shared_ptr<CudaLane>>(m, "CudaLane")
      .def(py::init([](int device, std::uintptr_t stream, std::string name) {
             return python_lane(new CudaLane(device, stream, std::move(name)));
           }),
           py::arg("device"), py::arg("stream") = 0, py::arg("name") = "cuda")
      .def_property_readonly("owns_stream", &CudaLane::owns_stream);
  py::module_::import("atexit").attr("register")(py::cpp_function(&drain_lanes_at_exit));

  py::class_<TensorView>(m, "TensorView", "Zero-copy view of core memory; torch.from_dlpack(view) aliases it.")
      .def("__dlpack__",
           [](const TensorView& v, py::object /*stream*/, py::object /*max_version*/, py::object dl_device,
              py::object copy) { return dlpack_capsule(v, dl_device, copy); },
           py::arg("stream") = py::none(), py::arg("max_version") = py::none(), py::arg("dl_device") = py::none(),
           py::arg("copy") = py::none())
      .def("__dlpack_device__",
           [](const TensorView& v) {
             auto d = dlpack_device(v);
             return py::make_tuple(int(d.device_type), d.device_id);
           })
      .def_property_readonly("shape", [](const TensorView& v) { return py::tuple(py::cast(v.shape)); })
      .def_property_readonly("dtype", [](const TensorView& v) { return dtype_name(v.dtype); })
      .def_property_readonly("device", [](const TensorView& v) { return v.device; })
      .def_property_readonly("nbytes", &TensorView::nbytes)
      .def_property_readonly("data_ptr", [](const TensorView& v) { return reinterpret_cast<std::uintptr_t>(v.data); });

  py::class_<BoundaryRing>(m, "BoundaryRing")
      .def(py::init([](const py::object& capacity, const py::object& batch, const py::object& d,
                       const py::object& vocab, const std::string& dtype, const py::object& device, bool shared) {
             return new BoundaryRing(as_int(capacity, "capacity"), as_int(batch, "batch"), as_int(d, "d"),
                                     int_arg(vocab, "vocab", INT64_MIN, INT64_MAX), parse_dtype(dtype),
                                     as_int(device, "device"), shared);
           }),
           py::arg("capacity"), py::arg("batch"), py::arg("d"), py::arg("vocab"), py::arg("dtype") = "float32",
           py::arg("device") = -1, py::arg("shared") = false)
      .def("acquire", [](BoundaryRing& ring, const py::object& lane) {
             Event guard;
             const int slot = ring.acquire_nowait(&guard);
             wait_released(guard, optional_arg<Lane>(lane));
             return slot;
           }, py::arg("lane") = py::none())
      .def("mark_ready", [](BoundaryRing& r, int slot, const py::object& e) { r.mark_ready(slot, optional_event(e)); },
           py::arg("slot"), py::arg("event") = py::none())
      .def("select",
           [](BoundaryRing& ring, int slot, const I64Array& r, const py::object& offsets, const py::object& lane) {
             if (r.ndim() != 1) throw py::value_error("r must be 1-D (one per request), got shape " + shape_str(r));
             auto out = out_array(offsets, ring.batch(), "offsets");
             const Event ready = ring.select_nowait(slot, r.data(), std::int64_t(r.shape(0)), out.second);
             wait_released(ready, optional_arg<Lane>(lane));
             return out.first;
           },
           py::arg("slot"), py::arg("r"), py::arg("offsets") = py::none(), py::arg("lane") = py::none(),
           "ready -> consumed; returns the element offsets of ring[slot][b][r[b]] (into `offsets` when given).")
      .def("release", [](BoundaryRing& r, int slot, const py::object& e) { r.release(slot, optional_event(e)); },
           py::arg("slot"), py::arg("event") = py::none())
      .def("reset", &BoundaryRing::reset, py::call_guard<py::gil_scoped_release>())
      .def("state", [](const BoundaryRing& r, int slot) { return slot_state_name(r.state(slot)); }, py::arg("slot"))
      .def("ready_event", &BoundaryRing::ready_event, py::arg("slot"))
      .def("view", &BoundaryRing::view)
      .def("slot", &BoundaryRing::slot_view, py::arg("slot"))
      .def_property_readonly("next_slot", &BoundaryRing::next_slot)
      .def_property_readonly("capacity", &BoundaryRing::capacity)
      .def_property_readonly("batch", &BoundaryRing::batch)
      .def_property_readonly("d", &BoundaryRing::d)
      .def_property_readonly("vocab", &BoundaryRing::vocab)
      .def_property_readonly("dtype", [](const BoundaryRing& r) { return dtype_name(r.dtype()); })
      .def_property_readonly("device", &BoundaryRing::device)
      .def_property_readonly("slot_elems", &BoundaryRing::slot_elems)
      .def_property_readonly("row_elems", &BoundaryRing::row_elems)
      .def_property_readonly("data_ptr", [](const BoundaryRing& r) { return reinterpret_cast<std::uintptr_t>(r.data()); })
      .def_property_readonly("shared_fd", &BoundaryRing::shared_fd, "The memfd a worker process maps, or -1.")
      .def_property_readonly("nbytes", &BoundaryRing::nbytes);

  py::class_<Staging>(m, "Staging")
      .def(py::init([](const py::object& batch, const py::object& d, const py::object& feature_bytes,
                       const py::object& device, bool shared) {
             const auto bytes = int_arg(feature_bytes, "feature_bytes", 0, std::int64_t(Staging::kMaxFeatureBytes));
             return new Staging(as_int(batch, "batch"), as_int(d, "d"), std::size_t(bytes), as_int(device, "device"),
                                shared);
           }),
           py::arg("batch"), py::arg("d"), py::arg("feature_bytes"), py::arg("device") = -1, py::arg("shared") = false)
      .def("view", [](const Staging& s, const std::string& region, int phase) {
             return s.view(parse_staging_region(region), phase);
           }, py::arg("region"), py::arg("phase"))
      .def("bytes", [](const Staging& s, const std::string& region) { return s.bytes(parse_staging_region(region)); },
           py::arg("region"))
      .def("data_ptr", [](const Staging& s, const std::string& region, int phase) {
             return reinterpret_cast<std::uintptr_t>(s.data(parse_staging_region(region), phase));
           }, py::arg("region"), py::arg("phase"))
      .def("copy_in", [](Staging& s, Lane& lane, const std::string& region, std::uintptr_t src, std::size_t nbytes,
                         int phase) {
             s.copy_in(lane, parse_staging_region(region), reinterpret_cast<const void*>(src), nbytes, phase);
           }, py::arg("lane"), py::arg("region"), py::arg("src_ptr"), py::arg("nbytes"), py::arg("phase"))
      .def("copy_out", [](Staging& s, Lane& lane, const std::string& region, std::uintptr_t dst, std::size_t nbytes,
                          int phase) {
             s.copy_out(lane, parse_staging_region(region), reinterpret_cast<void*>(dst), nbytes, phase);
           }, py::arg("lane"), py::arg("region"), py::arg("dst_ptr"), py::arg("nbytes"), py::arg("phase"))
      .def_property_readonly("batch", &Staging::batch)
      .def_property_readonly("d", &Staging::d)
      .def_property_readonly("feature_bytes", &Staging::feature_bytes)
      .def_property_readonly("pinned", &Staging::pinned)
      .def("offset", [](const Staging& s, const std::string& region, int phase) {
             return s.offset(parse_staging_region(region), phase);
           }, py::arg("region"), py::arg("phase"), "Bytes from the buffer's start to a region's phase.")
      .def_property_readonly("shared_fd", &Staging::shared_fd, "The memfd a worker process maps, or -1.")
      .def_property_readonly("nbytes", &Staging::nbytes)
      .def_property_readonly("device", &Staging::device);

  m.def("greedy_accept", [](const I64Array& draft, const I64Array& target_argmax) {
        if (draft.ndim() != 2) throw py::value_error("draft must be [batch, d], got shape " + shape_str(draft));
        const auto batch = draft.shape(0), d = draft.shape(1);
        const std::int64_t* p = expect_shape(target_argmax, {batch, d + 1}, "target_argmax");
        auto r = new_array({batch}), bonus = new_array({batch});
        greedy_accept(int(batch), int(d), draft.data(), p, r.mutable_data(), bonus.mutable_data());
        return py::make_tuple(r, bonus);
      }, py::arg("draft"), py::arg("target_argmax"),
      "Greedy acceptance: (r [B], bonus [B]) from draft [B, d] and target argmax [B, d+1].");

  // Buffers arrive as data_ptr() integers: dpara_rt.native checks the tensors' shapes, dtypes and layout.
  m.def("markov_head_host", [](std::uintptr_t boundary_ptr, const std::string& boundary_dtype, std::int64_t batch,
                               std::int64_t n_rows, int d, std::int64_t vocab, const I64Array& r,
                               const I64Array& bonus, std::uintptr_t w1_ptr, std::uintptr_t w2_ptr, std::int64_t rank,
                               double temperature, std::uint64_t seed, std::uint64_t offset,
                               const py::object& draft_out, std::uintptr_t q_ptr, std::uintptr_t w2t_ptr,
                               const std::string& w2t_dtype, std::uintptr_t w2_norms_ptr, std::uintptr_t noise_ptr,
                               MarkovBiasCache* cache) {
        const DType dtype = parse_dtype(boundary_dtype), w2t = parse_dtype(w2t_dtype);
        const std::int64_t* r_data = expect_shape(r, {batch}, "r");
        const std::int64_t* bonus_data = expect_shape(bonus, {batch}, "bonus");
        std::int64_t* draft = out_data(draft_out, {batch, d}, "draft_out");
        std::int64_t row_stride;  // contiguous rows; an overflow here means a bad d or vocab, which the core names
        if (__builtin_mul_overflow(std::int64_t(d), vocab, &row_stride)) row_stride = 0;
        py::gil_scoped_release nogil;
        markov_head_host(reinterpret_cast<const void*>(boundary_ptr), dtype, batch, n_rows, d, vocab, row_stride,
                         r_data, bonus_data, reinterpret_cast<const float*>(w1_ptr),
                         reinterpret_cast<const float*>(w2_ptr), rank, temperature, seed, offset, draft,
                         reinterpret_cast<float*>(q_ptr), reinterpret_cast<const void*>(w2t_ptr), w2t,
                         reinterpret_cast<const float*>(w2_norms_ptr), reinterpret_cast<const float*>(noise_ptr),
                         cache);
      }, py::arg("boundary_ptr"), py::arg("boundary_dtype"), py::arg("batch"), py::arg("n_rows"), py::arg("d"),
      py::arg("vocab"), py::arg("r"), py::arg("bonus"), py::arg("w1_ptr"), py::arg("w2_ptr"), py::arg("rank"),
      py::arg("temperature"), py::arg("seed"), py::arg("offset"), py::arg("draft_out"), py::arg("q_ptr"),
      py::arg("w2t_ptr") = 0, py::arg("w2t_dtype") = "float32", py::arg("w2_norms_ptr") = 0, py::arg("noise_ptr") = 0,
      py::arg("cache") = nullptr,
      "Host Markov head over contiguous boundary [B, n_rows, d, V] and float32 W1 [V, R], W2 [R, V]: writes "
      "draft_out [B, d] (and q [B, d, V] at q_ptr when temperature > 0; q_ptr 0 when greedy, or when sampling "
      "with noise_ptr: the draft alone, pruned, its q from markov_q_host). w2t_ptr / "
      "w2_norms_ptr: W2 transposed [V, R] (float32, or bfloat16 holding W2 exactly) and its column norms (rounded "
      "up) for bound-pruned greedy steps, or 0. noise_ptr: the call's Gumbel noise [B, d, V] float32 from "
      "gumbel_noise_host (sampling only), or 0 to draw it here. cache: a MarkovBiasCache of these W1 / W2, or None.");
  m.def("markov_head_hidden_host", [](std::uintptr_t hidden_ptr, std::int64_t batch, std::int64_t n_rows, int d,
                                      std::int64_t hidden_dim, const I64Array& r, std::uintptr_t head_ptr,
                                      const std::string& head_format, std::int64_t vocab, std::uintptr_t logits_ptr,
                                      const I64Array& bonus, std::uintptr_t w1_ptr, std::uintptr_t w2_ptr,
                                      std::int64_t rank, double temperature, std::uint64_t seed, std::uint64_t offset,
                                      const py::object& draft_out, std::uintptr_t q_ptr, std::uintptr_t w2t_ptr,
                                      const std::string& w2t_dtype, std::uintptr_t w2_norms_ptr,
                                      std::uintptr_t noise_ptr, MarkovBiasCache* cache) {
        const PackedFormat head = parse_packed_format(head_format);
        const DType w2t = parse_dtype(w2t_dtype);
        const std::int64_t* r_data = expect_shape(r, {batch}, "r");
        const std::int64_t* bonus_data = expect_shape(bonus, {batch}, "bonus");
        std::int64_t* draft = out_data(draft_out, {batch, d}, "draft_out");
        py::gil_scoped_release nogil;
        markov_head_hidden_host(reinterpret_cast<const float*>(hidden_ptr), batch, n_rows, d, hidden_dim, r_data,
                                reinterpret_cast<const void*>(head_ptr), head, vocab,
                                reinterpret_cast<float*>(logits_ptr), bonus_data,
                                reinterpret_cast<const float*>(w1_ptr), reinterpret_cast<const float*>(w2_ptr), rank,
                                temperature, seed, offset, draft, reinterpret_cast<float*>(q_ptr),
                                reinterpret_cast<const void*>(w2t_ptr), w2t,
                                reinterpret_cast<const float*>(w2_norms_ptr), reinterpret_cast<const float*>(noise_ptr),
                                cache);
      }, py::arg("hidden_ptr"), py::arg("batch"), py::arg("n_rows"), py::arg("d"), py::arg("hidden_dim"), py::arg("r"),
      py::arg("head_ptr"), py::arg("head_format"), py::arg("vocab"), py::arg("logits_ptr"), py::arg("bonus"),
      py::arg("w1_ptr"), py::arg("w2_ptr"), py::arg("rank"), py::arg("temperature"), py::arg("seed"),
      py::arg("offset"), py::arg("draft_out"), py::arg("q_ptr"), py::arg("w2t_ptr") = 0,
      py::arg("w2t_dtype") = "float32", py::arg("w2_norms_ptr") = 0, py::arg("noise_ptr") = 0,
      py::arg("cache") = nullptr,
      "The hidden ring's head: branch r of hidden [B, n_rows, d, H] float32 through the packed output head "
      "(host_linear_pack of [V, H]) into logits [B, d, V] at logits_ptr, then markov_head_host over them; the "
      "remaining arguments as markov_head_host's.");
  m.def("markov_q_host", [](std::uintptr_t boundary_ptr, const std::string& boundary_dtype, std::int64_t batch,
                            std::int64_t n_rows, int d, std::int64_t vocab, const I64Array& r, const I64Array& bonus,
                            const I64Array& draft, std::uintptr_t w1_ptr, std::uintptr_t w2_ptr, std::int64_t rank,
                            double temperature, std::uintptr_t q_ptr, MarkovBiasCache* cache) {
        const DType dtype = parse_dtype(boundary_dtype);
        const std::int64_t* r_data = expect_shape(r, {batch}, "r");
        const std::int64_t* bonus_data = expect_shape(bonus, {batch}, "bonus");
        const std::int64_t* draft_data = expect_shape(draft, {batch, d}, "draft");
        std::int64_t row_stride;
        if (__builtin_mul_overflow(std::int64_t(d), vocab, &row_stride)) row_stride = 0;
        py::gil_scoped_release nogil;
        markov_q_host(reinterpret_cast<const void*>(boundary_ptr), dtype, batch, n_rows, d, vocab, row_stride, r_data,
                      bonus_data, draft_data, reinterpret_cast<const float*>(w1_ptr),
                      reinterpret_cast<const float*>(w2_ptr), rank, temperature, reinterpret_cast<float*>(q_ptr), cache);
      }, py::arg("boundary_ptr"), py::arg("boundary_dtype"), py::arg("batch"), py::arg("n_rows"), py::arg("d"),
      py::arg("vocab"), py::arg("r"), py::arg("bonus"), py::arg("draft"), py::arg("w1_ptr"), py::arg("w2_ptr"),
      py::arg("rank"), py::arg("temperature"), py::arg("q_ptr"), py::arg("cache") = nullptr,
      "q [B, d, V] (at q_ptr) of the sampling markov_head_host call that drafted draft [B, d], bit for bit.");
  // The factors arrive as data_ptr() integers: dpara_rt.native.HostMarkovHead keeps the tensors alive.
  py::class_<MarkovBiasCache>(m, "MarkovBiasCache",
                              "Bias rows W1[x] @ W2 kept for the tokens x a Markov head drafted from lately.")
      .def(py::init([](std::uintptr_t w1_ptr, std::uintptr_t w2_ptr, std::int64_t vocab, std::int64_t rank,
                       std::int64_t capacity) {
             return new MarkovBiasCache(reinterpret_cast<const float*>(w1_ptr), reinterpret_cast<const float*>(w2_ptr),
                                        vocab, rank, capacity);
           }), py::arg("w1_ptr"), py::arg("w2_ptr"), py::arg("vocab"), py::arg("rank"), py::arg("capacity"))
      .def_property_readonly("capacity", &MarkovBiasCache::capacity)
      .def_property_readonly("hits", [](MarkovBiasCache& c) {
             std::lock_guard<std::mutex> lock(c.mutex());
             return c.hits();
           }, "Steps that found their token's row.")
      .def_property_readonly("misses", [](MarkovBiasCache& c) {
             std::lock_guard<std::mutex> lock(c.mutex());
             return c.misses();
           }, "Steps that computed their token's row.")
      .def("fill", [](MarkovBiasCache& c, const I64Array& tokens) {
             if (tokens.ndim() != 1)
               throw py::value_error("tokens must have shape (n,) (token ids), got " + shape_str(tokens));
             const std::int64_t n = tokens.shape(0);
             const std::int64_t* data = tokens.data();
             py::gil_scoped_release nogil;
             markov_bias_fill(c, data, n);
           }, py::arg("tokens"),
           "Compute the rows of tokens [n] (int64) not held yet, as the steps would: see markov_bias_fill.");
  // The memory is a mapping that dpara_rt.drafter_context keeps alive beside the object, in both processes.
  py::class_<Mailbox>(m, "Mailbox",
                      "A one-way queue of byte messages between two processes over shared memory (one writer, "
                      "one reader): a drafter worker's calls and replies.")
      .def(py::init([](std::uintptr_t address, std::size_t capacity, bool create) {
             return new Mailbox(reinterpret_cast<void*>(address), capacity, create);
           }),
           py::arg("address"), py::arg("capacity"), py::arg("create"),
           "The mailbox at `address` (bytes_for(capacity) bytes of a shared mapping, 64-byte aligned): laid out "
           "there when `create`, else attached to.")
      .def_static("bytes_for", &Mailbox::bytes_for, py::arg("capacity"))
      .def_property_readonly("capacity", &Mailbox::capacity)
      .def("push", [](Mailbox& box, const py::bytes& message, double timeout_s) {
             char* data = nullptr;
             Py_ssize_t n = 0;
             PyBytes_AsStringAndSize(message.ptr(), &data, &n);
             py::gil_scoped_release nogil;  // `message` keeps the bytes alive
             return box.push(data, std::size_t(n), timeout_s);
           }, py::arg("message"), py::arg("timeout_s"),
           "Append `message`, waiting up to timeout_s for room; False when there was none. Releases the GIL.")
      .def("pop", [](Mailbox& box, double spin_s, double timeout_s) -> py::object {
             std::string out;
             bool got = false;
             {
               py::gil_scoped_release nogil;
               got = box.pop(out, spin_s, timeout_s);
             }
             if (!got) return py::none();
             return py::bytes(out);
           }, py::arg("spin_s"), py::arg("timeout_s"),
           "The oldest message (bytes), spinning up to spin_s, then sleeping, for at most timeout_s; None then. "
           "Releases the GIL.")
      .def("ready", &Mailbox::ready, "Whether a message is waiting.")
      .def_property_readonly("sleepers", &Mailbox::sleepers, "Sides asleep in a wait on it now (not spinning).");
  m.def("gumbel_noise_host", [](std::uintptr_t out_ptr, std::int64_t batch, int d, std::int64_t vocab,
                                std::uint64_t seed, std::uint64_t offset) {
        py::gil_scoped_release nogil;
        gumbel_noise_host(reinterpret_cast<float*>(out_ptr), batch, d, vocab, seed, offset);
      }, py::arg("out_ptr"), py::arg("batch"), py::arg("d"), py::arg("vocab"), py::arg("seed"), py::arg("offset"),
      "The Gumbel noise a sampling markov_head_host call with these (batch, d, vocab, seed, offset) draws, into "
      "out [B, d, V] float32 (contiguous).");
  m.def("host_linear_packed_elems", [](std::int64_t n, std::int64_t k, const std::string& packed_format) {
        return host_linear_packed_elems(n, k, parse_packed_format(packed_format));
      }, py::arg("n"), py::arg("k"), py::arg("packed_format") = "float32",
        "Elements of host_linear_pack's output for an n x k weight in this format.");
  m.def("host_linear_bf16_dot_native", &host_linear_bf16_dot_native,
        "Whether bf16_dot products run on this CPU's AVX512-BF16 dot product (else an emulation, the same bits).");
  // Pointers as data_ptr() integers: dpara_rt.models.host_linear checks the tensors.
  m.def("host_linear_pack", [](std::uintptr_t w_ptr, std::int64_t n, std::int64_t k, std::uintptr_t packed_ptr,
                               const std::string& packed_format) {
        const PackedFormat format = parse_packed_format(packed_format);
        py::gil_scoped_release nogil;
        host_linear_pack(reinterpret_cast<const float*>(w_ptr), n, k, reinterpret_cast<void*>(packed_ptr), format);
      }, py::arg("w_ptr"), py::arg("n"), py::arg("k"), py::arg("packed_ptr"), py::arg("packed_format"),
      "Pack a float32 weight [n, k] into panels: 'float32', 'bfloat16' (every weight a bfloat16 value) or "
      "'bf16_dot' (bfloat16 pairs along k, rounded: products of x rounded to bfloat16).");
  m.def("host_linear", [](std::uintptr_t x_ptr, std::int64_t m, std::int64_t k, std::uintptr_t packed_ptr,
                          const std::string& packed_format, std::int64_t n, std::uintptr_t y_ptr,
                          std::int64_t col_begin, std::int64_t col_end) {
        const PackedFormat format = parse_packed_format(packed_format);
        py::gil_scoped_release nogil;
        host_linear_columns(reinterpret_cast<const float*>(x_ptr), m, k, reinterpret_cast<const void*>(packed_ptr),
                            format, n, col_begin, col_end < 0 ? n : col_end, reinterpret_cast<float*>(y_ptr), n);
      }, py::arg("x_ptr"), py::arg("m"), py::arg("k"), py::arg("packed_ptr"), py::arg("packed_format"), py::arg("n"),
      py::arg("y_ptr"), py::arg("col_begin") = 0, py::arg("col_end") = -1,
      "y [m, n] = x [m, k] @ W^T (float32, contiguous) over W packed by host_linear_pack; releases the GIL. "
      "col_begin / col_end (-1: n), on panel edges: only those output columns are written, with the bits the "
      "whole product gives them (two processes may split one product).");
  m.def("host_linear_two_threads", [](std::uintptr_t x_ptr, std::int64_t m, std::int64_t k, std::uintptr_t packed_ptr,
                                      const std::string& packed_format, std::int64_t n, std::uintptr_t y_ptr) {
        const PackedFormat format = parse_packed_format(packed_format);
        py::gil_scoped_release nogil;
        host_linear_two_threads(reinterpret_cast<const float*>(x_ptr), m, k, reinterpret_cast<const void*>(packed_ptr),
                                format, n, reinterpret_cast<float*>(y_ptr));
      }, py::arg("x_ptr"), py::arg("m"), py::arg("k"), py::arg("packed_ptr"), py::arg("packed_format"), py::arg("n"),
      py::arg("y_ptr"),
      "host_linear over the caller and the core's helper thread when the product is large (a prefill's); the same "
      "bits. Releases the GIL.");
  // The weights' pointers stay valid while dpara_rt.models.host_qwen3 holds the tensors beside this object.
  py::class_<HostQwen3Weights>(m, "HostQwen3Layer",
                               "One Qwen3 decoder layer's packed weights and norms (pointers), for host_qwen3_layer.")
      .def(py::init([](std::uintptr_t qkv, std::uintptr_t o, std::uintptr_t gate_up, std::uintptr_t down,
                       const std::vector<std::string>& packed_formats, std::uintptr_t input_norm,
                       std::uintptr_t post_norm, std::uintptr_t q_norm, std::uintptr_t k_norm) {
             if (packed_formats.size() != 4)
               throw std::invalid_argument("HostQwen3Layer: packed_formats has " +
                                           std::to_string(packed_formats.size()) +
                                           " names; expected 4 (qkv, o, gate_up, down)");
             HostQwen3Weights w;
             const std::uintptr_t ptrs[4] = {qkv, o, gate_up, down};
             HostPackedLinear* lins[4] = {&w.qkv, &w.o, &w.gate_up, &w.down};
             for (int i = 0; i < 4; ++i)
               *lins[i] = {reinterpret_cast<const void*>(ptrs[i]), parse_packed_format(packed_formats[i])};
             w.input_norm = reinterpret_cast<const float*>(input_norm);
             w.post_norm = reinterpret_cast<const float*>(post_norm);
             w.q_norm = reinterpret_cast<const float*>(q_norm);
             w.k_norm = reinterpret_cast<const float*>(k_norm);
             return w;
           }),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("packed_formats"),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"))
      .def("forward", [](const HostQwen3Weights& w, std::int64_t hidden, std::int64_t heads, std::int64_t kv_heads,
                         std::int64_t head_dim, std::int64_t intermediate, double eps, std::uintptr_t h,
                         std::int64_t batch, std::int64_t t, std::uintptr_t positions, std::uintptr_t cos,
                         std::uintptr_t sin, std::uintptr_t k_cache, std::uintptr_t v_cache, std::int64_t row_stride,
                         std::int64_t head_stride, std::int64_t max_len) {
             const HostQwen3Dims dims{hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps)};
             const HostKVLayer cache{reinterpret_cast<float*>(k_cache), reinterpret_cast<float*>(v_cache), row_stride,
                                     head_stride, max_len};
             py::gil_scoped_release nogil;
             host_qwen3_layer(dims, w, reinterpret_cast<float*>(h), batch, t,
                              reinterpret_cast<const std::int64_t*>(positions), reinterpret_cast<const float*>(cos),
                              reinterpret_cast<const float*>(sin), cache);
           },
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("h"), py::arg("batch"), py::arg("t"), py::arg("positions"), py::arg("cos"),
           py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("row_stride"), py::arg("head_stride"),
           py::arg("max_len"),
           "h [batch * t, hidden] float32 updated in place by the layer; positions [batch, t] int64; cos / sin "
           "[batch * t, head_dim]; the layer's K/V cache with the given strides (elements). Releases the GIL.");
  // A target's layers and KV cache, bound once per (packed layers, cache): a verify crosses into the core once, not
  // once per layer. The layers' tensors and the cache stay alive beside it (dpara_rt.models.host_qwen3).
  struct HostQwen3Stack {
    std::vector<HostQwen3Weights> weights;
    std::vector<HostKVLayer> caches;
    std::vector<std::int64_t> capture;
  };
  // A decode's verify bound once (HostQwen3Stack.verify_plan): each round passes only its tokens and buffers.
  struct HostQwen3Verify {
    const HostQwen3Stack* stack;
    HostQwen3Dims dims;
    HostQwen3Ends ends;
    std::int64_t last_capture, features_width;
    const std::int64_t* lengths;
  };
  auto host_ends = [](std::uintptr_t embed, std::int64_t vocab, std::uintptr_t cos_table, std::uintptr_t sin_table,
                      std::int64_t table_len, std::uintptr_t final_norm, double final_eps, std::uintptr_t head,
                      const std::string& head_format, std::int64_t head_vocab) {
    return HostQwen3Ends{reinterpret_cast<const float*>(embed), vocab, reinterpret_cast<const float*>(cos_table),
                         reinterpret_cast<const float*>(sin_table), table_len,
                         reinterpret_cast<const float*>(final_norm), static_cast<float>(final_eps),
                         {reinterpret_cast<const void*>(head), parse_packed_format(head_format)}, head_vocab};
  };
  py::class_<HostQwen3Stack>(m, "HostQwen3Stack", "A target's HostQwen3Layers over its KV cache, run in one call.")
      .def(py::init([](const std::vector<const HostQwen3Weights*>& layers, std::uintptr_t k, std::uintptr_t v,
                       std::int64_t layer_stride, std::int64_t row_stride, std::int64_t head_stride,
                       std::int64_t max_len, const std::vector<std::int64_t>& capture) {
             if (capture.size() != layers.size())
               throw std::invalid_argument("HostQwen3Stack: capture has " + std::to_string(capture.size()) +
                                           " entries; expected one per layer (" + std::to_string(layers.size()) + ")");
             HostQwen3Stack st;
             for (std::size_t i = 0; i < layers.size(); ++i) {
               if (!layers[i]) throw std::invalid_argument("HostQwen3Stack: layer " + std::to_string(i) + " is None");
               st.weights.push_back(*layers[i]);
               const std::int64_t off = static_cast<std::int64_t>(i) * layer_stride;
               st.caches.push_back({reinterpret_cast<float*>(k) + off, reinterpret_cast<float*>(v) + off, row_stride,
                                    head_stride, max_len});
             }
             st.capture = capture;
             return st;
           }),
           py::arg("layers"), py::arg("k"), py::arg("v"), py::arg("layer_stride"), py::arg("row_stride"),
           py::arg("head_stride"), py::arg("max_len"), py::arg("capture"))
      .def("forward", [](const HostQwen3Stack& st, std::int64_t hidden, std::int64_t heads, std::int64_t kv_heads,
                         std::int64_t head_dim, std::int64_t intermediate, double eps, std::uintptr_t h,
                         std::int64_t batch, std::int64_t t, std::uintptr_t positions, std::uintptr_t cos,
                         std::uintptr_t sin, std::uintptr_t features, std::int64_t features_width) {
             const HostQwen3Dims dims{hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps)};
             py::gil_scoped_release nogil;
             host_qwen3_layers(dims, st.weights.data(), st.caches.data(), static_cast<std::int64_t>(st.weights.size()),
                               reinterpret_cast<float*>(h), batch, t, reinterpret_cast<const std::int64_t*>(positions),
                               reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin),
                               st.capture.data(), reinterpret_cast<float*>(features), features_width);
           },
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("h"), py::arg("batch"), py::arg("t"), py::arg("positions"), py::arg("cos"),
           py::arg("sin"), py::arg("features"), py::arg("features_width"),
           "Every layer over h [batch * t, hidden] (float32, updated in place), as HostQwen3Layer.forward each; h "
           "after layer i copied into features [batch * t, features_width] at column capture[i] where that is >= 0. "
           "Releases the GIL.")
      .def("tokens_forward", [host_ends](const HostQwen3Stack& st, std::int64_t hidden, std::int64_t heads,
                                         std::int64_t kv_heads, std::int64_t head_dim, std::int64_t intermediate,
                                         double eps, std::uintptr_t embed, std::int64_t vocab,
                                         std::uintptr_t cos_table, std::uintptr_t sin_table, std::int64_t table_len,
                                         std::uintptr_t final_norm, double final_eps, std::uintptr_t head,
                                         const std::string& head_format, std::int64_t head_vocab,
                                         std::uintptr_t tokens, std::int64_t batch, std::int64_t t,
                                         std::uintptr_t positions, std::int64_t last_capture,
                                         std::uintptr_t features, std::int64_t features_width,
                                         std::uintptr_t logits) {
             const HostQwen3Dims dims{hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps)};
             const HostQwen3Ends ends = host_ends(embed, vocab, cos_table, sin_table, table_len, final_norm, final_eps,
                                                  head, head_format, head_vocab);
             py::gil_scoped_release nogil;
             host_qwen3_tokens(dims, st.weights.data(), st.caches.data(), static_cast<std::int64_t>(st.weights.size()),
                               ends, reinterpret_cast<const std::int64_t*>(tokens), batch, t,
                               reinterpret_cast<const std::int64_t*>(positions), st.capture.data(), last_capture,
                               reinterpret_cast<float*>(features), features_width, reinterpret_cast<float*>(logits));
           },
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("embed"), py::arg("vocab"), py::arg("cos_table"), py::arg("sin_table"),
           py::arg("table_len"), py::arg("final_norm"), py::arg("final_eps"), py::arg("head"), py::arg("head_format"),
           py::arg("head_vocab"), py::arg("tokens"), py::arg("batch"), py::arg("t"), py::arg("positions"),
           py::arg("last_capture"), py::arg("features"), py::arg("features_width"), py::arg("logits"),
           "A whole forward (host_qwen3_tokens): tokens [batch, t] and positions int64, the embedding [vocab, hidden], "
           "RoPE tables [table_len, head_dim] and final norm float32, the output head packed by host_linear_pack; "
           "logits [batch * t, head_vocab] float32, the capture as forward's plus the final-normed rows at column "
           "last_capture (-1: none). Releases the GIL.")
      .def("verify_plan", [host_ends](const HostQwen3Stack& st, std::int64_t hidden, std::int64_t heads,
                                      std::int64_t kv_heads, std::int64_t head_dim, std::int64_t intermediate,
                                      double eps, std::uintptr_t embed, std::int64_t vocab, std::uintptr_t cos_table,
                                      std::uintptr_t sin_table, std::int64_t table_len, std::uintptr_t final_norm,
                                      double final_eps, std::uintptr_t head, const std::string& head_format,
                                      std::int64_t head_vocab, std::int64_t last_capture, std::int64_t features_width,
                                      std::uintptr_t lengths) {
             return HostQwen3Verify{&st, {hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps)},
                                    host_ends(embed, vocab, cos_table, sin_table, table_len, final_norm, final_eps,
                                              head, head_format, head_vocab),
                                    last_capture, features_width, reinterpret_cast<const std::int64_t*>(lengths)};
           },
           py::keep_alive<0, 1>(), py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("intermediate"), py::arg("eps"), py::arg("embed"), py::arg("vocab"), py::arg("cos_table"),
           py::arg("sin_table"), py::arg("table_len"), py::arg("final_norm"), py::arg("final_eps"), py::arg("head"),
           py::arg("head_format"), py::arg("head_vocab"), py::arg("last_capture"), py::arg("features_width"),
           py::arg("lengths"),
           "A decode's verify bound once: tokens_forward's ends and capture, and the cache's committed lengths "
           "[batch] int64, read at each run (the caller keeps every buffer alive and in place).")
      .def("block_forward", [](const HostQwen3Stack& st, std::int64_t hidden, std::int64_t heads,
                               std::int64_t kv_heads, std::int64_t head_dim, std::int64_t intermediate, double eps,
                               std::uintptr_t h, std::int64_t batch, std::int64_t t, std::uintptr_t ctx_lens,
                               std::uintptr_t visible, std::int64_t visible_stride, std::uintptr_t cos,
                               std::uintptr_t sin, std::int64_t keep_from, std::uintptr_t final_norm,
                               std::uintptr_t out) {
             const HostQwen3Dims dims{hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps)};
             py::gil_scoped_release nogil;
             host_block_layers(dims, st.weights.data(), st.caches.data(), static_cast<std::int64_t>(st.weights.size()),
                               reinterpret_cast<float*>(h), batch, t, reinterpret_cast<const std::int64_t*>(ctx_lens),
                               reinterpret_cast<const std::uint8_t*>(visible), visible_stride,
                               reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin), keep_from,
                               reinterpret_cast<const float*>(final_norm), reinterpret_cast<float*>(out));
           },
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("h"), py::arg("batch"), py::arg("t"), py::arg("ctx_lens"), py::arg("visible"),
           py::arg("visible_stride"), py::arg("cos"), py::arg("sin"), py::arg("keep_from"), py::arg("final_norm"),
           py::arg("out"),
           "A drafter's backbone (host_block_layers) over blocks of rows, its cache the drafter's context cache: h "
           "[batch * t, hidden] float32 (overwritten), ctx_lens [batch] int64, visible [t, t] or [batch, t, t] uint8 "
           "(visible_stride 0 or t * t), cos / sin [batch * t, head_dim]; out [batch * (t - keep_from), hidden] "
           "the final-normed rows keep_from.. of each block. Releases the GIL.")
      .def("context_forward", [](const HostQwen3Stack& st, std::int64_t hidden, std::int64_t heads,
                                 std::int64_t kv_heads, std::int64_t head_dim, std::int64_t intermediate, double eps,
                                 std::uintptr_t fc, const std::string& fc_format, std::int64_t feature_width,
                                 std::uintptr_t context_norm, std::uintptr_t features, std::int64_t batch,
                                 std::int64_t t, std::uintptr_t lengths, std::uintptr_t counts, std::uintptr_t cos,
                                 std::uintptr_t sin) {
             const HostQwen3Dims dims{hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps)};
             const HostPackedLinear fc_w{reinterpret_cast<const void*>(fc), parse_packed_format(fc_format)};
             py::gil_scoped_release nogil;
             host_context_kv(dims, st.weights.data(), st.caches.data(), static_cast<std::int64_t>(st.weights.size()),
                             fc_w, feature_width, reinterpret_cast<const float*>(context_norm),
                             reinterpret_cast<const float*>(features), batch, t,
                             reinterpret_cast<const std::int64_t*>(lengths),
                             reinterpret_cast<const std::int64_t*>(counts), reinterpret_cast<const float*>(cos),
                             reinterpret_cast<const float*>(sin));
           },
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("fc"), py::arg("fc_format"), py::arg("feature_width"), py::arg("context_norm"),
           py::arg("features"), py::arg("batch"), py::arg("t"), py::arg("lengths"), py::arg("counts"), py::arg("cos"),
           py::arg("sin"),
           "A drafter's context update (host_context_kv) into its context cache: features [batch * t, feature_width] "
           "float32, fc packed by host_linear_pack, lengths / counts [batch] int64, cos / sin [batch * t, head_dim] "
           "at positions lengths[b] + j. Releases the GIL.");
  py::class_<HostQwen3Verify>(m, "HostQwen3Verify", "A decode's verify bound once (HostQwen3Stack.verify_plan).")
      .def("run", [](const HostQwen3Verify& p, std::uintptr_t tokens, std::int64_t batch, std::int64_t t,
                     std::uintptr_t features, std::uintptr_t logits, std::uintptr_t argmax_out) {
             const HostQwen3Stack& st = *p.stack;
             py::gil_scoped_release nogil;
             return host_qwen3_verify(p.dims, st.weights.data(), st.caches.data(),
                                      static_cast<std::int64_t>(st.weights.size()), p.ends,
                                      reinterpret_cast<const std::int64_t*>(tokens), batch, t, p.lengths,
                                      st.capture.data(), p.last_capture, reinterpret_cast<float*>(features),
                                      p.features_width, reinterpret_cast<float*>(logits),
                                      reinterpret_cast<std::int64_t*>(argmax_out));
           },
           py::arg("tokens"), py::arg("batch"), py::arg("t"), py::arg("features"), py::arg("logits"),
           py::arg("argmax_out"),
           "host_qwen3_verify: tokens [batch, t] int64 at each row's committed length; features [batch * t, "
           "features_width] (0 without capture), logits [batch * t, head_vocab] float32 and argmax_out [batch * t] "
           "int64 written. Returns whether every logit is finite. Releases the GIL.");
  m.def("host_rms_norm", [](std::uintptr_t x_ptr, std::uintptr_t w_ptr, std::int64_t rows, std::int64_t n, double eps,
                            std::uintptr_t out_ptr) {
        py::gil_scoped_release nogil;
        host_rms_norm(reinterpret_cast<const float*>(x_ptr), reinterpret_cast<const float*>(w_ptr), rows, n,
                      static_cast<float>(eps), reinterpret_cast<float*>(out_ptr));
      }, py::arg("x_ptr"), py::arg("w_ptr"), py::arg("rows"), py::arg("n"), py::arg("eps"), py::arg("out_ptr"),
      "out [rows, n] = RMSNorm of x [rows, n] with weight w [n] (float32, contiguous), as HostQwen3Layer's norms.");
  m.def("philox4x32", &philox4x32_10, py::arg("counter"), py::arg("offset"), py::arg("seed"),
        "First output word of Philox4x32-10 at counter (counter, offset_lo, offset_hi, 0), key seed.");
  // Buffers as data_ptr() integers (numpy views would cost more than the work at small batch): dpara_rt.native
  // checks the tensors; the core checks every extent, token id and uniform.
  m.def("argmax_finite_host", [](std::uintptr_t x_ptr, std::int64_t rows, std::int64_t vocab,
                                 const py::object& argmax_out) {
        std::int64_t* out = out_data(argmax_out, {rows}, "argmax_out");
        py::gil_scoped_release nogil;
        return argmax_finite_host(reinterpret_cast<const float*>(x_ptr), rows, vocab, out);
      }, py::arg("x_ptr"), py::arg("rows"), py::arg("vocab"), py::arg("argmax_out"),
      "Per row of x [rows, vocab] float32 (contiguous) the first index of its largest value, into argmax_out [rows] "
      "(int64); False (argmax_out unspecified) when any value is NaN or infinite.");
  m.def("verify_sample_host", [](std::uintptr_t p_ptr, std::uintptr_t q_ptr, std::uintptr_t draft_ptr,
                                 std::uintptr_t u_accept_ptr, std::uintptr_t u_bonus_ptr, std::int64_t batch, int d,
                                 std::int64_t vocab, std::uintptr_t r_ptr, std::uintptr_t bonus_ptr) {
        py::gil_scoped_release nogil;
        verify_sample_host(reinterpret_cast<const float*>(p_ptr), reinterpret_cast<const float*>(q_ptr),
                           reinterpret_cast<const std::int64_t*>(draft_ptr),
                           reinterpret_cast<const float*>(u_accept_ptr), reinterpret_cast<const float*>(u_bonus_ptr),
                           batch, d, vocab, reinterpret_cast<std::int64_t*>(r_ptr),
                           reinterpret_cast<std::int64_t*>(bonus_ptr));
      }, py::arg("p_ptr"), py::arg("q_ptr"), py::arg("draft_ptr"), py::arg("u_accept_ptr"), py::arg("u_bonus_ptr"),
      py::arg("batch"), py::arg("d"), py::arg("vocab"), py::arg("r_ptr"), py::arg("bonus_ptr"),
      "Lossless rejection-sampling verification (verify_sample_reference's decisions) over contiguous float32 "
      "p [B, d+1, V], q [B, d, V], u_accept [B, d], u_bonus [B] and int64 draft [B, d]: writes int64 r and bonus "
      "[B] at r_ptr and bonus_ptr.");

  m.def("inverse_cdf_host", [](std::uintptr_t w_ptr, std::uintptr_t u_ptr, std::int64_t rows, std::int64_t vocab,
                               std::uintptr_t out_ptr) {
        py::gil_scoped_release nogil;
        inverse_cdf_host(reinterpret_cast<const float*>(w_ptr), reinterpret_cast<const float*>(u_ptr), rows, vocab,
                         reinterpret_cast<std::int64_t*>(out_ptr));
      }, py::arg("w_ptr"), py::arg("u_ptr"), py::arg("rows"), py::arg("vocab"), py::arg("out_ptr"),
      "inverse_cdf's draw over contiguous float32 weights w [rows, vocab] and uniforms u [rows]: writes int64 "
      "[rows] at out_ptr.");

  m.def("tree_metadata", [](const py::object& d_arg) {
        const int d = as_int(d_arg, "d");
        const TreeMeta t = tree_meta(d);
        py::dict out;
        out["d"] = d;
        out["rows"] = t.rows();
        out["query_branch"] = to_array(t.query_branch);
        out["query_pos_offset"] = to_array(t.query_pos_offset);
        out["query_spine_limit"] = to_array(t.query_spine_limit);
        out["key_spine"] = to_array(t.key_spine);
        out["key_branch"] = to_array(t.key_branch);
        return out;
      }, py::arg("d"), "Spine+branch tree metadata: spine rows 0..d, then branch r's d rows for r = 0..d.");
  m.def("tree_mask", [](const py::object& d) {
        const TreeMeta t = tree_meta(as_int(d, "d"));
        const int rows = t.rows();
        py::array_t<bool> mask({rows, rows});
        auto w = mask.mutable_unchecked<2>();
        for (int q = 0; q < rows; ++q)
          for (int k = 0; k < rows; ++k) w(q, k) = t.visible(q, k);
        return mask;
      }, py::arg("d"), "Dense [rows, rows] visibility among tree tokens (context keys are always visible).");

  // Getters are methods (batch(), finished(b), ...); per-round results can go into caller-owned int64
  // arrays (r, bonus, committed) so a round allocates nothing.
  py::class_<RoundState>(m, "RoundState")
      .def(py::init([](const py::object& batch, const py::object& d, const py::object& max_new_tokens,
                       const py::object& eos_ids, const py::object& max_len) {
             return new RoundState(as_int(batch, "batch"), as_int(d, "d"),
                                   int_arg(max_new_tokens, "max_new_tokens", INT64_MIN, INT64_MAX),
                                   token_ids(eos_ids, "eos_ids"), int_arg(max_len, "max_len", INT64_MIN, INT64_MAX));
           }),
           py::arg("batch"), py::arg("d"), py::arg("max_new_tokens"), py::arg("eos_ids"), py::arg("max_len"))
      .def("start", [](RoundState& s, const I64Array& prompt_lens, const I64Array& first_tokens,
                       const py::object& committed) {
             auto c = out_array(committed, s.batch(), "committed");
             s.start(expect_shape(prompt_lens, {s.batch()}, "prompt_lens"),
                     expect_shape(first_tokens, {s.batch()}, "first_tokens"), c.second);
             return c.first;
           }, py::arg("prompt_lens"), py::arg("first_tokens"), py::arg("committed") = py::none())
      .def("admit", [](RoundState& s, const py::object& b, const py::object& prompt_len, const py::object& first_token,
                       const py::object& max_new_tokens, const py::object& stop_ids) {
             return s.admit(as_int(b, "b"), int_arg(prompt_len, "prompt_len", INT64_MIN, INT64_MAX),
                            int_arg(first_token, "first_token", INT64_MIN, INT64_MAX),
                            int_arg(max_new_tokens, "max_new_tokens", INT64_MIN, INT64_MAX),
                            token_ids(stop_ids, "stop_ids"));
           }, py::arg("b"), py::arg("prompt_len"), py::arg("first_token"), py::arg("max_new_tokens"),
           py::arg("stop_ids") = py::list(),
           "Between rounds: finished row b starts a new request (its prompt cached, its first token committed).")
      .def("retire", [](RoundState& s, const py::object& b) { s.retire(as_int(b, "b")); }, py::arg("b"),
           "End row b's request now (reason 'cancelled').")
      .def("grow", [](RoundState& s, const py::object& batch) { s.grow(as_int(batch, "batch")); }, py::arg("batch"),
           "Continuous batching: this many rows from now on; the new ones are free.")
      .def("set_draft", [](RoundState& s, const I64Array& draft) {
             s.set_draft(expect_shape(draft, {s.batch(), s.d()}, "draft"));
           }, py::arg("draft"))
      .def("step", [](RoundState& s, const I64Array& target_argmax, int slot, const py::object& r,
                      const py::object& bonus, const py::object& committed) {
             auto ro = out_array(r, s.batch(), "r"), bo = out_array(bonus, s.batch(), "bonus"),
                  co = out_array(committed, s.batch(), "committed");
             s.step(expect_shape(target_argmax, {s.batch(), s.d() + 1}, "target_argmax"), slot, ro.second, bo.second,
                    co.second);
             return py::make_tuple(ro.first, bo.first, co.first);
           }, py::arg("target_argmax"), py::arg("slot") = -1, py::arg("r") = py::none(), py::arg("bonus") = py::none(),
           py::arg("committed") = py::none(),
           "Fused round: greedy acceptance + commit + spine update + slot history -> (r, bonus, committed).")
      .def("commit", [](RoundState& s, const I64Array& r, const I64Array& bonus, int slot, const py::object& committed) {
             auto c = out_array(committed, s.batch(), "committed");
             s.commit(expect_shape(r, {s.batch()}, "r"), expect_shape(bonus, {s.batch()}, "bonus"), slot, c.second);
             return c.first;
           }, py::arg("r"), py::arg("bonus"), py::arg("slot") = -1, py::arg("committed") = py::none())
      .def("accept", [](RoundState& s, const I64Array& block, const py::object& target_argmax, const py::object& r,
                        const py::object& bonus, int slot, Metrics& metrics) {
             if (block.ndim() != 2 || block.shape(0) != s.batch())
               throw py::value_error("block must have shape (" + std::to_string(s.batch()) + ", T), got " +
                                     shape_str(block));
             const py::ssize_t B = s.batch(), T = block.shape(1);
             const bool greedy = !target_argmax.is_none();
             I64Array argmax = greedy ? target_argmax.cast<I64Array>() : I64Array();
             I64Array r_in = r.is_none() ? I64Array() : r.cast<I64Array>();
             I64Array bonus_in = bonus.is_none() ? I64Array() : bonus.cast<I64Array>();
             auto r_out = new_array({B}), bonus_out = new_array({B}), committed = new_array({B}), keep = new_array({B});
             s.accept(block.data(), int(T), greedy ? expect_shape(argmax, {B, T}, "target_argmax") : nullptr,
                      r.is_none() ? nullptr : expect_shape(r_in, {B}, "r"),
                      bonus.is_none() ? nullptr : expect_shape(bonus_in, {B}, "bonus"), slot, metrics,
                      r_out.mutable_data(), bonus_out.mutable_data(), committed.mutable_data(), keep.mutable_data());
             py::list tokens;  // what each request committed: the tail of its output
             for (int b = 0; b < s.batch(); ++b) {
               const auto& out = s.output(b);
               const auto n = std::size_t(committed.at(b));
               tokens.append(py::cast(std::vector<std::int64_t>(out.end() - std::ptrdiff_t(n), out.end())));
             }
             return py::make_tuple(r_out, bonus_out, committed, keep, tokens);
           }, py::arg("block"), py::arg("target_argmax"), py::arg("r"), py::arg("bonus"), py::arg("slot"),
           py::arg("metrics"),
           "A verified round in one call (RoundState::accept): block [B, T] as verified, then target_argmax [B, T] "
           "(greedy) or r and bonus [B] (any rule; an AR round: T = 1, r = 0), None for what is not given; records "
           "the acceptance in metrics -> (r, bonus, committed, keep, tokens committed per request).")
      .def("spine", [](const RoundState& s) {
             auto out = new_array({s.batch(), s.d() + 1});
             for (int b = 0; b < s.batch(); ++b) std::copy(s.spine(b), s.spine(b) + s.d() + 1, out.mutable_data(b, 0));
             return out;
           })
      .def("output", [](const RoundState& s, int b) { return py::cast(s.output(b)); }, py::arg("b"),
           "Tokens committed for request b so far (list of int).")
      .def("outputs", [](const RoundState& s) {
             py::list out;
             for (int b = 0; b < s.batch(); ++b) out.append(py::cast(s.output(b)));
             return out;
           })
      .def("slots", [](const RoundState& s, int b) { return to_array(s.slots(b)); }, py::arg("b"),
           "Ring slot of each round request b took part in.")
      .def("finished", [](const RoundState& s, int b) { return s.finished(b); }, py::arg("b"))
      .def("finished", [](const RoundState& s) {
             py::array_t<bool> out(s.batch());
             for (int b = 0; b < s.batch(); ++b) out.mutable_at(b) = s.finished(b);
             return out;
           })
      .def("reason", [](const RoundState& s, int b) { return finish_reason_name(s.reason(b)); }, py::arg("b"))
      .def("committed_lens", [](const RoundState& s) { return per_request(s, &RoundState::committed_len); })
      .def("prompt_lens", [](const RoundState& s) { return per_request(s, &RoundState::prompt_len); })
      .def("target_pos", [](const RoundState& s) { return per_request(s, &RoundState::target_pos); })
      .def("drafter_pos", [](const RoundState& s) { return per_request(s, &RoundState::drafter_pos); })
      .def("num_running", &RoundState::num_running)
      .def("rounds", &RoundState::rounds)
      .def("started", &RoundState::started)
      .def("batch", &RoundState::batch)
      .def("d", &RoundState::d)
      .def("max_new_tokens", &RoundState::max_new_tokens)
      .def("max_len", &RoundState::max_len)
      .def("eos_ids", &RoundState::eos_ids);

  py::class_<Metrics>(m, "Metrics")
      .def(py::init([](const py::object& d) { return new Metrics(as_int(d, "d")); }), py::arg("d"))
      .def("add_event", &Metrics::add_event, py::arg("round"), py::arg("phase"), py::arg("lane"), py::arg("start_ns"),
           py::arg("end_ns"))
      .def("record_round", [](Metrics& mt, const I64Array& r, bool fallback) {
             if (r.ndim() != 1) throw py::value_error("r must be 1-D (one per request), got shape " + shape_str(r));
             mt.record_round(r.data(), std::int64_t(r.shape(0)), fallback);
           }, py::arg("r"), py::arg("fallback") = false)
      .def("record_fallback", &Metrics::record_fallback)
      .def("histogram", [](const Metrics& mt) { return to_array(mt.histogram()); })
      .def("events", [](const Metrics& mt) {
             py::list out;
             for (const auto& e : mt.events())
               out.append(py::dict(py::arg("round") = e.round, py::arg("phase") = e.phase, py::arg("lane") = e.lane,
                                   py::arg("start_ns") = e.start_ns, py::arg("end_ns") = e.end_ns));
             return out;
           })
      .def("overlap", [](const Metrics& mt, const std::string& verify, const std::vector<std::string>& drafting) {
             const TimelineOverlap o = mt.overlap(verify, drafting);
             return py::dict(py::arg("gaps") = o.gaps, py::arg("mean_gap_ns") = o.mean_gap_ns,
                             py::arg("drafting_ns") = o.drafting_ns, py::arg("hidden_ns") = o.hidden_ns);
           }, py::arg("verify"), py::arg("drafting"),
           "The mean gap between consecutive `verify` spans and the drafting phases' total and hidden ns.")
      .def("phase_totals_ns", [](const Metrics& mt) {
             py::dict out;
             for (const auto& [phase, ns] : mt.phase_totals()) out[py::str(phase)] = ns;
             return out;
           })
      .def("chrome_trace", &Metrics::chrome_trace_json, "Chrome / Perfetto trace JSON of the timeline.")
      .def("clear", &Metrics::clear)
      .def_property_readonly("rounds", &Metrics::rounds)
      .def_property_readonly("fallbacks", &Metrics::fallbacks)
      .def_property_readonly("tau", &Metrics::tau)
      .def_property_readonly("d", &Metrics::d);
}
