// One-line TypeErrors for native calls whose arguments pybind11 cannot bind.
#pragma once

#include <pybind11/pybind11.h>

namespace swa_bindings {

// Every function and method of module m (and of the classes it defines) raises, for a
// call pybind11 cannot bind, a one-line TypeError naming what is wrong: a missing, extra
// or misspelt argument (Python's own wording), or the argument whose type does not fit
// ("need_size: expected an int, got str"). Without it pybind11 raises a multi-line text
// listing the signatures and the call's values. A call that binds runs as before: the
// explanation is made only after pybind11 has refused the call. Run it once, after
// every function is defined.
void explain_argument_errors(pybind11::module_& m);

}  // namespace swa_bindings
