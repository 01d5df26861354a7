// The benchmarks' floor: the cheapest native call taking a call's tensors. It crosses
// pybind11 as an allocator method does and does no work (it returns its last argument),
// so that a row can say how much of a call's time is the crossing itself. The bench's
// own module, built by bench/setup.py: swa_ext's wheel does not carry it.
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_floor, m) {
  m.def("floor", [](const py::args& args) { return args[args.size() - 1]; },
        "The cheapest native call taking a call's tensors: returns its last argument.");
}
