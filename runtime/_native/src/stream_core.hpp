// The stream engine's core: no Python here, so the sanitizer tests drive it directly.
//
// Semantics are specified in runtime/stream.py and implemented literally by
// runtime/stream_reference.py; this is the fast version of the same thing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "event_log.hpp"
#include "key_table.hpp"

namespace skiff::stream {

constexpr int64_t kNone = std::numeric_limits<int64_t>::min();  // "no match"
constexpr int64_t kMaxTs = int64_t{1} << 62;

enum class Agg : int32_t { Count, Sum, Mean, Min, Max, Std, Last, Distinct, Histogram };
enum class WindowKind : int32_t { Sliding, Tumbling, Count };
enum class Cmp : int32_t { Eq, Ne, Lt, Le, Gt, Ge };
enum class Op : int32_t { Contiguous, Gap };

struct Condition {
  bool on_value = false;
  int32_t field = 0;
  Cmp cmp = Cmp::Eq;
  double lit_value = 0;  // used when on_value
  int64_t lit_key = 0;   // used otherwise
};

struct StepDef {
  int32_t type = 0;
  Op op = Op::Contiguous;
  std::vector<Condition> conditions;
};

struct FeatureDef {
  Agg agg = Agg::Count;
  int32_t field = -1;  // value field, -1 for count
  WindowKind window = WindowKind::Count;
  int64_t size = 1;
  int32_t of = -1;  // event type filter, -1 for all
  std::vector<double> edges;
};

struct TriggerDef {
  int32_t by = 0;
  int64_t within = -1;  // -1: no span limit
  std::vector<StepDef> steps;
  std::vector<FeatureDef> features;
  // Set by the engine: triggers added after the first push form a new generation (their
  // own tries and key state), so adding them leaves every other trigger's state as it
  // was. A removed trigger stays compiled (its group's layout is unchanged) but never
  // fires; a generation whose triggers are all removed is dropped with its keys.
  int32_t generation = 0;
  bool removed = false;
};

struct Config {
  int32_t n_types = 1;
  int32_t n_keys = 0;
  int32_t n_values = 0;
  std::vector<std::string> value_names;  // for error messages
  int64_t lateness = 0;
  int64_t max_keys = int64_t{1} << 20;
  int64_t ttl = -1;  // -1: keys never expire by age
};

// One pushed batch, already copied out of Python (row-major keys and values).
struct Batch {
  std::vector<int64_t> ts;
  std::vector<int32_t> types;
  std::vector<int64_t> keys;
  std::vector<double> values;
  size_t size() const { return ts.size(); }
};

struct Firings {
  std::vector<int32_t> trigger_id;
  std::vector<int64_t> key, ts, event_index, window_start, window_end, row;
  // Feature matrices of the triggers that fired, in the order they first fired: kept
  // sparse so a push costs nothing per trigger that did not fire.
  std::vector<int32_t> fired;                  // trigger ids
  std::vector<std::vector<double>> matrices;   // per fired entry: rows * width, row-major
  std::vector<int64_t> rows;                   // per fired entry: number of firings

  // The trigger's matrix, or nullptr if it did not fire (a linear search: for tests).
  const std::vector<double>* matrix(int32_t trigger) const {
    for (size_t i = 0; i < fired.size(); ++i) {
      if (fired[i] == trigger) return &matrices[i];
    }
    return nullptr;
  }
};

struct Stats {
  int64_t live_keys = 0;
  int64_t live_events = 0;
  int64_t state_bytes = 0;
  int64_t events = 0;
  int64_t firings = 0;
  int64_t evicted_keys = 0;
  int64_t watermark = kNone;
  int64_t trie_nodes = 0;
};

class InputError : public std::runtime_error {
 public:
  enum class Kind { UnknownType, TimestampRange, NonFinite, Late };
  InputError(Kind kind_, size_t index_, const std::string& message)
      : std::runtime_error(message), kind(kind_), index(index_) {}
  Kind kind;
  size_t index;
};

class StateError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// A snapshot payload that is malformed, or inconsistent with the engine's triggers.
class SnapshotError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Engine {
 public:
  explicit Engine(Config config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Returns the new trigger's id (ids are never reused). Added after the first push, it
  // starts with fresh key state; the other triggers keep theirs.
  int32_t add_trigger(const TriggerDef& trigger);
  // Stops a trigger firing at once (StateError if unknown or already removed).
  void remove_trigger(int32_t trigger);
  int32_t trigger_count() const;
  int32_t trigger_width(int32_t trigger) const;

  // Validates the whole batch (InputError, nothing applied), then applies it.
  void push(const Batch& batch, Firings& out);
  Stats stats() const;

  // The engine's state (keys, logs, matching progress, counters; not its config or
  // trigger definitions) as bytes that `restore` reads back (snapshot.hpp: the layout).
  std::string snapshot() const;
  // Replaces the state with a snapshot's, taken from an engine with the same config and
  // trigger definitions (the caller checks those). Throws SnapshotError and leaves the
  // engine unchanged if the payload is malformed or does not fit the triggers.
  void restore(const std::string& payload);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace skiff::stream
