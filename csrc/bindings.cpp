// All Python bindings of the core live in this one file.
#include <pybind11/pybind11.h>

#include "dpara_rt/build_info.h"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = "dpara_rt scheduling core";
  m.def("build_info", [] {
    auto info = dpara_rt::build_info();
    py::dict d;
    d["compiler"] = info.compiler;
    d["cuda_compiled"] = info.cuda_compiled;
    d["cuda_runtime_version"] = info.cuda_runtime_version;
    d["cuda_devices"] = info.cuda_devices;
    d["cuda_status"] = info.cuda_status;
    return d;
  });
}
