#pragma once

#include <pybind11/pybind11.h>

namespace skiff::stream {

// Adds the `Engine` class (the native half of runtime.stream.StreamEngine).
void register_stream(pybind11::module_& m);

}  // namespace skiff::stream
