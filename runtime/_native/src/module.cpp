// The private extension module runtime._native._core: one register_* call per area.
#include <pybind11/pybind11.h>

#include "bind_stream.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() = "Skiff's private native code. Use the typed facade in runtime.stream instead.";
  skiff::stream::register_stream(m);
}
