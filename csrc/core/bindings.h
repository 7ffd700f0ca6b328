#pragma once
// Private to the two bindings files of the module dpara_rt._core: csrc/core/bindings.cpp, which defines the module,
// and csrc/host/bindings.cpp (bind_host). The argument helpers both use.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace py = pybind11;

namespace dpara_rt::bindings {

using I64Array = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>;

// A Python tuple's spelling of a shape, "(2, 3)" or "(2,)" (no iostreams: see detail::append).
template <class It>
std::string tuple_str(It first, It last) {
  std::string out = "(";
  for (It it = first; it != last; ++it) out += (it == first ? "" : ", ") + std::to_string(*it);
  return out + (last - first == 1 ? ",)" : ")");
}

inline std::string shape_str(const py::array& a) { return tuple_str(a.shape(), a.shape() + a.ndim()); }

inline std::string dims_str(std::initializer_list<py::ssize_t> dims) { return tuple_str(dims.begin(), dims.end()); }

// Checks that `a` has exactly the shape `dims` and returns its data.
inline const std::int64_t* expect_shape(const I64Array& a, std::initializer_list<py::ssize_t> dims, const char* name) {
  bool ok = a.ndim() == py::ssize_t(dims.size());
  for (std::size_t i = 0; ok && i < dims.size(); ++i) ok = a.shape(py::ssize_t(i)) == dims.begin()[i];
  if (!ok) throw py::value_error(std::string(name) + " must have shape " + dims_str(dims) + ", got " + shape_str(a));
  return a.data();
}

// The data of a caller-owned output: a writable C-contiguous int64 numpy array of exactly `dims`.
inline std::int64_t* out_data(const py::object& given, std::initializer_list<py::ssize_t> dims, const char* name) {
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

// Adds the host compute (host linear layer, host Qwen3 layers, Markov head, verification) to the module.
void bind_host(py::module_& m);

}  // namespace dpara_rt::bindings
