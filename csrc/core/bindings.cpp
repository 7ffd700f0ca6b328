// The module dpara_rt._core: this file defines it and binds the scheduling core; csrc/host/bindings.cpp adds
// the host compute (bind_host). Bindings only convert arguments (numpy arrays through the buffer protocol, Python
// callables, DLPack capsules) and manage the GIL; the logic is in the libraries.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>
#include <cstdint>
#include <cstdio>

#include "bindings.h"
#include "dpara_rt/build_info.h"
#include "dpara_rt/dlpack.h"
#include "dpara_rt/lane.h"
#include "dpara_rt/mailbox.h"
#include "dpara_rt/metrics.h"
#include "dpara_rt/ring.h"
#include "dpara_rt/round_state.h"
#include "dpara_rt/staging.h"
#include "dpara_rt/types.h"

using namespace dpara_rt;
using namespace dpara_rt::bindings;

namespace {

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

I64Array new_array(std::initializer_list<py::ssize_t> dims) { return I64Array(std::vector<py::ssize_t>(dims)); }

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
      .def("take", [](BoundaryRing& ring, int slot, const py::object& lane) {
             ring.take(slot, optional_arg<Lane>(lane));
           }, py::arg("slot"), py::arg("lane") = py::none(),
           "ready -> consumed for a reader that picks each request's branch itself (r in device memory).")
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

  // The memory is a mapping that dpara_rt.host.context keeps alive beside the object, in both processes.
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

  bind_host(m);  // csrc/host/bindings.cpp
}
