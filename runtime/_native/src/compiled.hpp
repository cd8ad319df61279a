// The engine's compiled form of its triggers: one trie per partition key field.
//
// Trie nodes are shared by every trigger whose pattern starts with the same steps (an
// edge is keyed by (op, event type, conditions)). Each edge is filed under its event
// type, so an event only visits the edges it can possibly match. Edges of a type are
// ordered deepest first: an event then reads every parent's state before any edge of
// the same event overwrites it (one event is never used twice in one match).
#pragma once

#include <cstdint>
#include <vector>

#include "stream_core.hpp"

namespace skiff::stream {

// Per key, a node with `~>` children keeps `any` (latest start of a partial match ending
// at any event so far) in a slot; a node with `->` children is recorded in the key's
// short `last` list when the key's latest event reached it (with that match's start).
struct Edge {
  int32_t parent_node;  // -1 for the root
  int32_t parent_type;  // event type of the parent's step (-1 for the root)
  int32_t parent_any;   // the parent's `any` slot (for a `~>` edge)
  int32_t child_node;
  int32_t child_any;    // the child's `any` slot, -1 if it has no `~>` children
  bool child_last;      // the child has `->` children: record it in `last`
  Op op;
  int32_t depth;
  int32_t cond_begin, cond_end;  // into Group::conditions
  int32_t term_begin, term_end;  // triggers ending at the child, into Group::terminals
};

// One log per stream a group's features read: all events (of = -1) or one type.
struct LogSpec {
  int32_t of = -1;
  std::vector<int32_t> columns;  // value fields stored, in column order
  int64_t keep = 0;              // rows always kept: largest count window reading it
  int64_t reach = -1;            // largest time-window reach, -1 if none reads it
};

struct CompiledFeature {
  Agg agg;
  WindowKind window;
  int64_t size;
  int32_t log;     // into Group::logs
  int32_t column;  // into the log's columns, -1 for count
  int32_t edges_begin, edges_end;  // into Engine edges storage
  int32_t offset;  // first output column
};

struct CompiledTrigger {
  int32_t group;
  int64_t within;
  int32_t width;
  std::vector<CompiledFeature> features;
};

struct Group {
  int32_t by = 0;
  int32_t n_any = 0;  // nodes with `~>` children (per-key `any` slots)
  int32_t n_nodes = 0;
  std::vector<std::vector<Edge>> edges_by_type;
  std::vector<Condition> conditions;
  std::vector<int32_t> terminals;
  std::vector<int64_t> terminal_within;  // each terminal's span limit, next to it
  std::vector<LogSpec> logs;
  std::vector<std::vector<int32_t>> logs_by_type;  // logs each event type is appended to
};

struct Compiled {
  std::vector<Group> groups;  // ascending partition key field
  std::vector<CompiledTrigger> triggers;
  std::vector<double> edges;  // histogram edges of all features
};

Compiled compile(const Config& config, const std::vector<TriggerDef>& triggers);

}  // namespace skiff::stream
