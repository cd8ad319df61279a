// Python binding of the stream engine: converts inputs, releases the GIL, wraps outputs.
#include "bind_stream.hpp"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "stream_core.hpp"

namespace py = pybind11;

namespace skiff::stream {
namespace {

using CondTuple = std::tuple<bool, int32_t, int32_t, double, int64_t>;
using StepTuple = std::tuple<int32_t, int32_t, std::vector<CondTuple>>;
using FeatureTuple = std::tuple<int32_t, int32_t, int32_t, int64_t, int32_t, std::vector<double>>;

// Hands a vector's buffer to numpy without copying: the capsule owns the vector.
template <class T>
py::array_t<T> to_array(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  if (v.empty()) return py::array_t<T>(shape);
  auto* owner = new std::vector<T>(std::move(v));
  py::capsule base(owner, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(shape, owner->data(), base);
}

template <class T>
void copy_array(const py::array& a, const char* name, size_t ndim, std::vector<T>& out) {
  // The facade checks dtypes and shapes with clear messages; this is the last guard
  // against a direct caller handing us memory of another layout.
  if (!a.dtype().is(py::dtype::of<T>()) || static_cast<size_t>(a.ndim()) != ndim ||
      !(a.flags() & py::array::c_style)) {
    throw py::type_error(std::string(name) + ": wrong dtype, rank or layout");
  }
  out.resize(static_cast<size_t>(a.size()));  // reused buffer: no page faults once warm
  if (!out.empty()) std::memcpy(out.data(), a.data(), out.size() * sizeof(T));
}

TriggerDef make_trigger(int32_t by, int64_t within, const std::vector<StepTuple>& steps,
                        const std::vector<FeatureTuple>& features) {
  TriggerDef def;
  def.by = by;
  def.within = within;
  for (const auto& [type, op, conds] : steps) {
    StepDef step{type, static_cast<Op>(op), {}};
    if (op < 0 || op > 1) throw py::value_error("bad step operator");
    for (const auto& [on_value, field, cmp, lit_value, lit_key] : conds) {
      step.conditions.push_back(Condition{on_value, field, static_cast<Cmp>(cmp), lit_value, lit_key});
    }
    def.steps.push_back(std::move(step));
  }
  for (const auto& [agg, field, window, size, of, edges] : features) {
    def.features.push_back(
        FeatureDef{static_cast<Agg>(agg), field, static_cast<WindowKind>(window), size, of, edges});
  }
  return def;
}

class PyEngine {
 public:
  PyEngine(int32_t n_types, int32_t n_keys, std::vector<std::string> value_names,
           int64_t lateness, int64_t max_keys, int64_t ttl)
      : engine_(Config{n_types, n_keys, static_cast<int32_t>(value_names.size()), value_names,
                       lateness, max_keys, ttl}) {}

  int32_t add_trigger(int32_t by, int64_t within, const std::vector<StepTuple>& steps,
                      const std::vector<FeatureTuple>& features) {
    TriggerDef def = make_trigger(by, within, steps, features);
    std::lock_guard<std::mutex> lock(mutex_);
    return engine_.add_trigger(def);
  }

  void remove_trigger(int32_t trigger) {
    std::lock_guard<std::mutex> lock(mutex_);
    engine_.remove_trigger(trigger);
  }

  py::bytes snapshot() {
    std::string payload;
    {
      // Safe without the GIL: only the C++ engine is read, into a C++ string; the
      // mutex keeps pushes from other threads out meanwhile.
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mutex_);
      payload = engine_.snapshot();
    }
    return py::bytes(payload);
  }

  void restore(const py::bytes& data) {
    std::string payload = data;  // copied out of Python first
    // Safe without the GIL: only the copy above and the C++ engine are touched.
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mutex_);
    engine_.restore(payload);
  }

  py::dict push_batch(const py::array& ts, const py::array& types, const py::array& keys,
                      const py::array& values) {
    std::unique_ptr<Batch> batch = take_spare();
    copy_array(ts, "ts", 1, batch->ts);
    copy_array(types, "types", 1, batch->types);
    copy_array(keys, "keys", 2, batch->keys);
    copy_array(values, "values", 2, batch->values);
    Firings out;
    try {
      // Safe without the GIL: the inputs were copied into `batch` above and the
      // outputs are plain C++ vectors, so nothing in this scope touches a Python
      // object. The mutex serialises pushes from several threads on one engine.
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mutex_);
      engine_.push(*batch, out);
    } catch (...) {
      give_back(std::move(batch));
      throw;
    }
    give_back(std::move(batch));
    return wrap(std::move(out));
  }

  py::dict stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    const Stats s = engine_.stats();
    py::dict d;
    d["live_keys"] = s.live_keys;
    d["live_events"] = s.live_events;
    d["state_bytes"] = s.state_bytes;
    d["events"] = s.events;
    d["firings"] = s.firings;
    d["evicted_keys"] = s.evicted_keys;
    d["watermark"] = s.watermark == kNone ? py::object(py::none()) : py::int_(s.watermark);
    d["trie_nodes"] = s.trie_nodes;
    return d;
  }

 private:
  py::dict wrap(Firings&& out) {
    const auto n = static_cast<py::ssize_t>(out.trigger_id.size());
    py::dict d;
    d["trigger_id"] = to_array(std::move(out.trigger_id), {n});
    d["key"] = to_array(std::move(out.key), {n});
    d["ts"] = to_array(std::move(out.ts), {n});
    d["event_index"] = to_array(std::move(out.event_index), {n});
    d["window_start"] = to_array(std::move(out.window_start), {n});
    d["window_end"] = to_array(std::move(out.window_end), {n});
    d["row"] = to_array(std::move(out.row), {n});
    py::dict features;
    for (size_t i = 0; i < out.fired.size(); ++i) {
      const auto width = static_cast<py::ssize_t>(engine_.trigger_width(out.fired[i]));
      features[py::int_(out.fired[i])] = to_array(std::move(out.matrices[i]), {out.rows[i], width});
    }
    d["features"] = features;
    return d;
  }

  // Input buffers are recycled across pushes: a fresh multi-megabyte vector per batch
  // costs more in page faults than the copy itself. One per concurrent pusher at most.
  std::unique_ptr<Batch> take_spare() {
    std::lock_guard<std::mutex> lock(spare_mutex_);
    if (spare_.empty()) return std::make_unique<Batch>();
    std::unique_ptr<Batch> batch = std::move(spare_.back());
    spare_.pop_back();
    return batch;
  }

  void give_back(std::unique_ptr<Batch> batch) {
    std::lock_guard<std::mutex> lock(spare_mutex_);
    if (spare_.size() < 2) spare_.push_back(std::move(batch));
  }

  Engine engine_;
  std::mutex mutex_;
  std::mutex spare_mutex_;
  std::vector<std::unique_ptr<Batch>> spare_;
};

const char* error_class(InputError::Kind kind) {
  switch (kind) {
    case InputError::Kind::UnknownType: return "UnknownEventTypeError";
    case InputError::Kind::TimestampRange: return "TimestampRangeError";
    case InputError::Kind::NonFinite: return "NonFiniteValueError";
    case InputError::Kind::Late: return "LateEventError";
  }
  return "StreamInputError";
}

// Raises `name` from runtime.stream_spec (the public exception types live in Python).
void raise_python(const char* name, const char* message, py::object index) {
  py::object cls = py::module_::import("runtime.stream_spec").attr(name);
  py::object exc = index.is_none() ? cls(message) : cls(message, index);
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

}  // namespace

void register_stream(py::module_& m) {
  py::class_<PyEngine>(m, "Engine")
      .def(py::init<int32_t, int32_t, std::vector<std::string>, int64_t, int64_t, int64_t>(),
           py::arg("n_types"), py::arg("n_keys"), py::arg("value_names"), py::arg("lateness"),
           py::arg("max_keys"), py::arg("ttl"))
      .def("add_trigger", &PyEngine::add_trigger, py::arg("by"), py::arg("within"),
           py::arg("steps"), py::arg("features"))
      .def("push_batch", &PyEngine::push_batch, py::arg("ts"), py::arg("types"), py::arg("keys"),
           py::arg("values"))
      .def("remove_trigger", &PyEngine::remove_trigger, py::arg("trigger"))
      .def("snapshot", &PyEngine::snapshot)
      .def("restore", &PyEngine::restore, py::arg("payload"))
      .def("stats", &PyEngine::stats);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InputError& e) {
      raise_python(error_class(e.kind), e.what(), py::int_(e.index));
    } catch (const StateError& e) {
      raise_python("EngineStateError", e.what(), py::none());
    } catch (const SnapshotError& e) {
      raise_python("SnapshotError", e.what(), py::none());
    }
  });
}

}  // namespace skiff::stream
