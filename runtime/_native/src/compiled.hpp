// The engine's compiled form of its triggers: one trie per partition key field.
//
// Trie nodes are shared by every trigger whose pattern starts with the same steps (an
// edge is keyed by (op, event type, conditions)). Each edge is filed under its event
// type, so an event only visits the edges it can possibly match:
// * root and `~>` edges, deepest first: an event then reads every parent's `any` slot
//   before an edge of the same event overwrites it (one event is never used twice);
// * `->` edges, after those (they read only the previous event's `last`, and no `->`
//   edge reads `any`), sorted by the parent's event type: an event only visits the ones
//   whose parent the key's previous event can have reached.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "stream_core.hpp"

namespace skiff::stream {

// Per key, a node with `~>` children keeps `any` (latest start of a partial match ending
// at any event so far) in a slot; a node with `->` children is recorded in the key's
// short `last` list when the key's latest event reached it (with that match's start).
struct Edge {
  int32_t parent;       // root: -1; `~>`: the parent's `any` slot; `->`: the parent node
  int32_t parent_type;  // event type of the parent's step (-1 for the root)
  int32_t child_any;    // the child's `any` slot, -1 if it has no `~>` children
  int32_t child_last;   // the child node if it has `->` children (goes in `last`), else -1
  int32_t cond_begin, cond_end;  // into Group::conditions
  int32_t term_begin, term_end;  // triggers ending at the child, into Group::terminals
  // The largest span limit of those triggers (int64 max if one has none, min if none
  // end here): a match with t - start beyond it fires none of them, tested once.
  int64_t term_span;
};

// One log per stream a group's features read: all events (of = -1) or one type. Its
// rows are kept in arrival order for count windows (the last `keep`) and sorted by ts
// for time windows (while within lateness + `reach` of the watermark).
struct LogSpec {
  int32_t of = -1;
  std::vector<int32_t> columns;  // value fields stored, in column order
  int64_t keep = 0;              // rows kept in arrival order: largest count window
  int64_t reach = -1;            // largest time-window reach, -1 if none reads it
  std::vector<int32_t> windows;  // into Group::windows
};

// One aggregation over one window, shared by every feature asking for it.
struct Stat {
  Agg agg;
  int32_t column;                  // log column, -1 for count
  int32_t edges_begin, edges_end;  // into Compiled::edges (histogram)
  int32_t out;                     // first of its outputs in the window's outputs
  int32_t sum = -1, sq = -1;       // running sums (sum, mean, std) and squares (std)
  int32_t extreme = -1;            // min/max: its monotonic queue
  int32_t bins = -1;               // histogram: first of its running bin counts
};

// A window (kind, size) over one log and what it aggregates. Its per-key running state
// (runtime/_native/src/windows.hpp) keeps one running sum per entry of `sum_columns`,
// one of squares per `sq_columns`, one min/max queue per `extremes` (column, is_max).
struct WindowSpec {
  int32_t log;
  WindowKind kind;
  int64_t size;
  std::vector<Stat> stats;
  int32_t n_out = 0;
  std::vector<int32_t> sum_columns, sq_columns;
  std::vector<std::pair<int32_t, bool>> extremes;
  int32_t n_bins = 0;
};

// A feature reads `width` outputs of one window into the trigger's row at `offset`.
struct CompiledFeature {
  int32_t window;  // into Group::windows
  int32_t out;     // first output in the window's outputs
  int32_t width;
  int32_t offset;  // first output column
};

// A trigger whose features are all one-value stats (count, sum, mean, min, max, last)
// of scanned windows over one log: time windows (read from the arrival ring while the
// key has no sorted ring) and count windows of kScanRows rows at most. At a firing they
// are read straight into the feature row (fused_scan.cpp), without query_window's
// per-window dispatch, stamps and output buffers.
struct ScanPart {
  WindowKind kind;
  int64_t size;
  Agg agg;
  int32_t column;  // log column, -1 for count
  int32_t offset;  // output column
};

struct ScanPlan {
  int32_t log = -1;   // -1: no plan (the features are read window by window)
  bool time = false;  // some part is a time window (needs the key's sorted ring empty)
  std::vector<ScanPart> parts;
};

struct CompiledTrigger {
  int32_t group;
  int64_t within;
  int32_t width;
  // The first trigger of the group with the same features: triggers firing at the same
  // event with the same features get the same row, computed once.
  int32_t same_features;
  std::vector<CompiledFeature> features;
  ScanPlan scan;
};

constexpr int32_t kContiguousIndexTypes = 64;

struct Group {
  int32_t by = 0;
  bool live = false;  // some member trigger is not removed (else no key state is kept)
  int32_t n_any = 0;  // nodes with `~>` children (per-key `any` slots)
  int32_t n_nodes = 0;
  // The most nodes with `->` children one event can reach (those of its type): the
  // room for a key's `last` list (Partition).
  int32_t max_reached = 0;
  // Edges of type t: root and `~>` ones in [free_begin[t], free_begin[t + 1]) of
  // `free_edges`, `->` ones in [contiguous_begin[t], contiguous_begin[t + 1]).
  std::vector<Edge> free_edges, contiguous_edges;
  std::vector<int32_t> free_begin, contiguous_begin;
  // With few event types (kContiguousIndexTypes at most): the `->` edges of type t whose
  // parent's type is u are [contiguous_at[t * (n + 1) + u], contiguous_at[t * (n + 1) + u + 1])
  // (n types), so an event visits only the edges its key's previous event can continue.
  std::vector<int32_t> contiguous_at;
  std::vector<Condition> conditions;
  std::vector<int32_t> terminals;
  std::vector<int64_t> terminal_within;  // each terminal's span limit, next to it
  std::vector<LogSpec> logs;
  std::vector<std::vector<int32_t>> logs_by_type;  // logs each event type is appended to
  std::vector<WindowSpec> windows;
  int32_t window_base = 0;  // this group's first window in the engine-wide numbering
};

struct Compiled {
  std::vector<Group> groups;  // ascending (generation, partition key field)
  std::vector<CompiledTrigger> triggers;
  std::vector<double> edges;  // histogram edges of all features
  int32_t n_windows = 0;      // over all groups
};

Compiled compile(const Config& config, const std::vector<TriggerDef>& triggers);

// Throws std::invalid_argument naming what is out of range in a trigger definition.
void check_trigger(const Config& config, const TriggerDef& trigger);

}  // namespace skiff::stream
