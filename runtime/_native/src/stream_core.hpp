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
  std::vector<std::vector<double>> features;  // per trigger id: rows * width, row-major
  std::vector<int64_t> rows;                  // per trigger id: number of firings
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

class Engine {
 public:
  explicit Engine(Config config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Returns the new trigger's id; only before the first push (StateError after).
  int32_t add_trigger(const TriggerDef& trigger);
  int32_t trigger_count() const;
  int32_t trigger_width(int32_t trigger) const;

  // Validates the whole batch (InputError, nothing applied), then applies it.
  void push(const Batch& batch, Firings& out);
  Stats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace skiff::stream
