// Builds the per-partition-field tries and log layouts from the registered triggers.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

#include "compiled.hpp"
#include "windows.hpp"  // kScanRows, one_pass

namespace skiff::stream {
namespace {

struct Node {
  int32_t parent;
  Op op;
  int32_t type;
  std::vector<Condition> conditions;
  int32_t depth;
  bool gap_children = false;
  bool contiguous_children = false;
  std::vector<int32_t> terminals;
};

template <class T>
void append_bytes(std::string& out, const T& value) {
  char buf[sizeof(T)];
  std::memcpy(buf, &value, sizeof(T));
  out.append(buf, sizeof(T));
}

// Edge identity: two steps share a trie node iff parent, op, type and conditions agree.
std::string edge_key(int32_t parent, Op op, int32_t type, const std::vector<Condition>& conds) {
  std::string key;
  append_bytes(key, parent);
  append_bytes(key, op);
  append_bytes(key, type);
  for (const Condition& c : conds) {
    append_bytes(key, c.on_value);
    append_bytes(key, c.field);
    append_bytes(key, c.cmp);
    append_bytes(key, c.on_value ? c.lit_value : 0.0);
    append_bytes(key, c.on_value ? int64_t{0} : c.lit_key);
  }
  return key;
}

std::vector<Condition> canonical(std::vector<Condition> conds) {
  std::sort(conds.begin(), conds.end(), [](const Condition& a, const Condition& b) {
    return std::tie(a.on_value, a.field, a.cmp, a.lit_value, a.lit_key) <
           std::tie(b.on_value, b.field, b.cmp, b.lit_value, b.lit_key);
  });
  return conds;
}

// A group: the triggers of one generation partitioned by one key field.
using GroupId = std::pair<int32_t, int32_t>;  // (generation, by)

bool member(const TriggerDef& def, GroupId id) { return def.generation == id.first && def.by == id.second; }

std::vector<Node> build_trie(const std::vector<TriggerDef>& defs, GroupId id) {
  std::vector<Node> nodes;
  std::map<std::string, int32_t> index;
  for (size_t t = 0; t < defs.size(); ++t) {
    if (!member(defs[t], id)) continue;
    int32_t parent = -1;
    for (size_t j = 0; j < defs[t].steps.size(); ++j) {
      const StepDef& step = defs[t].steps[j];
      const Op op = j == 0 ? Op::Contiguous : step.op;
      std::vector<Condition> conds = canonical(step.conditions);
      const auto [it, fresh] =
          index.emplace(edge_key(parent, op, step.type, conds), static_cast<int32_t>(nodes.size()));
      if (fresh) {
        nodes.push_back(Node{parent, op, step.type, std::move(conds), static_cast<int32_t>(j), false, false, {}});
      }
      if (parent >= 0) (op == Op::Gap ? nodes[parent].gap_children : nodes[parent].contiguous_children) = true;
      parent = it->second;
    }
    // A removed trigger keeps its trie path (its group's layout, and so the state of
    // the group's other triggers, stays as it was) but never fires.
    if (!defs[t].removed) nodes[parent].terminals.push_back(static_cast<int32_t>(t));
  }
  return nodes;
}

// Sorts edges by (type, sort key, trie order) into `edges`, with begin[t] the first edge
// of type t (begin has n_types + 1 entries).
void flatten(std::vector<std::tuple<int32_t, int32_t, size_t, Edge>> sorted, int32_t n_types,
             std::vector<Edge>& edges, std::vector<int32_t>& begin) {
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    return std::tie(std::get<0>(a), std::get<1>(a), std::get<2>(a)) <
           std::tie(std::get<0>(b), std::get<1>(b), std::get<2>(b));
  });
  begin.assign(static_cast<size_t>(n_types) + 1, 0);
  for (const auto& entry : sorted) {
    ++begin[static_cast<size_t>(std::get<0>(entry)) + 1];
    edges.push_back(std::get<3>(entry));
  }
  for (int32_t t = 0; t < n_types; ++t) begin[t + 1] += begin[t];
}

void add_edges(Group& group, const std::vector<Node>& nodes, int32_t n_types) {
  std::vector<int32_t> slot(nodes.size(), -1);
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].gap_children) slot[i] = group.n_any++;
  }
  group.n_nodes = static_cast<int32_t>(nodes.size());
  // One event reaches a node through its one edge, of the node's type: an event reaches
  // at most the nodes of its type that have `->` children.
  std::vector<int32_t> reachable(static_cast<size_t>(n_types), 0);
  for (const Node& n : nodes) {
    if (n.contiguous_children) {
      group.max_reached = std::max(group.max_reached, ++reachable[static_cast<size_t>(n.type)]);
    }
  }
  // (type, sort key, edge): the sort key is -depth for free edges, the parent's type for
  // `->` ones; ties keep trie order.
  std::vector<std::tuple<int32_t, int32_t, size_t, Edge>> free, contiguous;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    const bool root = n.parent < 0;
    const bool gap = !root && n.op == Op::Gap;
    const int32_t parent_type = root ? -1 : nodes[n.parent].type;
    Edge e{root ? -1 : gap ? slot[n.parent] : n.parent, parent_type, slot[i],
           n.contiguous_children ? static_cast<int32_t>(i) : -1, 0, 0, 0, 0, 0};
    e.cond_begin = static_cast<int32_t>(group.conditions.size());
    group.conditions.insert(group.conditions.end(), n.conditions.begin(), n.conditions.end());
    e.cond_end = static_cast<int32_t>(group.conditions.size());
    e.term_begin = static_cast<int32_t>(group.terminals.size());
    group.terminals.insert(group.terminals.end(), n.terminals.begin(), n.terminals.end());
    e.term_end = static_cast<int32_t>(group.terminals.size());
    if (root || gap) {
      free.emplace_back(n.type, -n.depth, i, e);
    } else {
      contiguous.emplace_back(n.type, parent_type, i, e);
    }
  }
  flatten(std::move(free), n_types, group.free_edges, group.free_begin);
  flatten(std::move(contiguous), n_types, group.contiguous_edges, group.contiguous_begin);
  if (n_types > kContiguousIndexTypes) return;
  // Within a type, `->` edges are sorted by their parent's type.
  const auto n = static_cast<size_t>(n_types);
  group.contiguous_at.assign(n * (n + 1), 0);
  for (size_t t = 0; t < n; ++t) {
    int32_t e = group.contiguous_begin[t];
    for (size_t u = 0; u <= n; ++u) {
      while (e < group.contiguous_begin[t + 1] &&
             static_cast<size_t>(group.contiguous_edges[e].parent_type) < u) {
        ++e;
      }
      group.contiguous_at[t * (n + 1) + u] = e;
    }
  }
}

int32_t log_for(Group& group, int32_t of) {
  for (size_t i = 0; i < group.logs.size(); ++i) {
    if (group.logs[i].of == of) return static_cast<int32_t>(i);
  }
  group.logs.push_back(LogSpec{of, {}, 0, -1, {}});
  return static_cast<int32_t>(group.logs.size() - 1);
}

int32_t column_for(LogSpec& log, int32_t field) {
  if (field < 0) return -1;
  const auto it = std::find(log.columns.begin(), log.columns.end(), field);
  if (it != log.columns.end()) return static_cast<int32_t>(it - log.columns.begin());
  log.columns.push_back(field);
  return static_cast<int32_t>(log.columns.size() - 1);
}

int32_t window_for(Group& group, int32_t log, WindowKind kind, int64_t size) {
  for (size_t i = 0; i < group.windows.size(); ++i) {
    const WindowSpec& w = group.windows[i];
    if (w.log == log && w.kind == kind && w.size == size) return static_cast<int32_t>(i);
  }
  const auto index = static_cast<int32_t>(group.windows.size());
  group.windows.push_back(WindowSpec{log, kind, size, {}, 0, {}, {}, {}, 0});
  group.logs[log].windows.push_back(index);
  return index;
}

template <class T>
int32_t slot_for(std::vector<T>& slots, const T& value) {
  const auto it = std::find(slots.begin(), slots.end(), value);
  if (it != slots.end()) return static_cast<int32_t>(it - slots.begin());
  slots.push_back(value);
  return static_cast<int32_t>(slots.size() - 1);
}

// The window's stat for (agg, column, edges), added with its running state if new.
const Stat& stat_for(WindowSpec& w, const FeatureDef& f, int32_t column,
                     std::vector<double>& edges) {
  for (const Stat& s : w.stats) {
    const bool same_edges =
        static_cast<size_t>(s.edges_end - s.edges_begin) == f.edges.size() &&
        std::equal(f.edges.begin(), f.edges.end(), edges.begin() + s.edges_begin);
    if (s.agg == f.agg && s.column == column && same_edges) return s;
  }
  Stat s{f.agg, column, static_cast<int32_t>(edges.size()), 0, w.n_out};
  edges.insert(edges.end(), f.edges.begin(), f.edges.end());
  s.edges_end = static_cast<int32_t>(edges.size());
  const int32_t width = f.agg == Agg::Histogram ? static_cast<int32_t>(f.edges.size()) - 1 : 1;
  w.n_out += width;
  if (f.agg == Agg::Sum || f.agg == Agg::Mean || f.agg == Agg::Std) {
    s.sum = slot_for(w.sum_columns, column);
  }
  if (f.agg == Agg::Std) s.sq = slot_for(w.sq_columns, column);
  if (f.agg == Agg::Min || f.agg == Agg::Max) {
    s.extreme = slot_for(w.extremes, std::make_pair(column, f.agg == Agg::Max));
  }
  if (f.agg == Agg::Histogram) {
    s.bins = w.n_bins;
    w.n_bins += width;
  }
  w.stats.push_back(s);
  return w.stats.back();
}

CompiledTrigger compile_features(const TriggerDef& def, int32_t group_index, Group& group,
                                 std::vector<double>& edges) {
  CompiledTrigger out{group_index, def.within, 0, -1, {}, {}};
  for (const FeatureDef& f : def.features) {
    const int32_t log = log_for(group, f.of);
    const int32_t column = column_for(group.logs[log], f.field);
    LogSpec& spec = group.logs[log];
    if (f.window == WindowKind::Count) {
      spec.keep = std::max(spec.keep, f.size);
    } else {
      spec.reach = std::max(spec.reach, f.window == WindowKind::Sliding ? f.size : 2 * f.size);
    }
    const int32_t window = window_for(group, log, f.window, f.size);
    const Stat& stat = stat_for(group.windows[window], f, column, edges);
    const int32_t width = f.agg == Agg::Histogram ? static_cast<int32_t>(f.edges.size()) - 1 : 1;
    out.features.push_back(CompiledFeature{window, stat.out, width, out.width});
    out.width += width;
  }
  return out;
}

// The trigger's one-pass plan (compiled.hpp), if its features allow one: after all of
// its group's triggers are compiled (a window's stats are known then).
ScanPlan scan_plan(const CompiledTrigger& trigger, const Group& group) {
  ScanPlan plan;
  constexpr size_t kMaxParts = 8;
  if (trigger.features.empty() || trigger.features.size() > kMaxParts) return plan;
  for (const CompiledFeature& f : trigger.features) {
    const WindowSpec& w = group.windows[static_cast<size_t>(f.window)];
    if (f.width != 1 || !w.sq_columns.empty() || w.n_bins != 0) return ScanPlan{};
    if (plan.parts.empty()) plan.log = w.log;
    if (w.log != plan.log) return ScanPlan{};
    const auto stat = std::find_if(w.stats.begin(), w.stats.end(),
                                   [&](const Stat& st) { return st.out == f.out; });
    if (stat == w.stats.end()) return ScanPlan{};
    const Agg agg = stat->agg;
    if (!one_pass(agg)) return ScanPlan{};
    if (w.kind == WindowKind::Count && w.size > kScanRows) return ScanPlan{};
    plan.time |= w.kind != WindowKind::Count;
    plan.parts.push_back(ScanPart{w.kind, w.size, agg, stat->column, f.offset});
  }
  return plan;
}

std::string features_key(const CompiledTrigger& trigger) {
  std::string key;
  for (const CompiledFeature& f : trigger.features) {
    append_bytes(key, f.window);
    append_bytes(key, f.out);
    append_bytes(key, f.width);
  }
  return key;
}

}  // namespace

void check_trigger(const Config& c, const TriggerDef& t) {
  auto fail = [](const char* what) { throw std::invalid_argument(what); };
  if (t.by < 0 || t.by >= c.n_keys) fail("partition key field out of range");
  if (t.steps.empty()) fail("a pattern needs at least one step");
  if (t.within < -1 || t.within > kMaxTs) fail("within out of range");
  for (const StepDef& s : t.steps) {
    if (s.type < 0 || s.type >= c.n_types) fail("step event type out of range");
    for (const Condition& cond : s.conditions) {
      const int32_t n = cond.on_value ? c.n_values : c.n_keys;
      if (cond.field < 0 || cond.field >= n) fail("condition field out of range");
      if (static_cast<int32_t>(cond.cmp) < 0 || static_cast<int32_t>(cond.cmp) > 5) fail("bad comparison");
    }
  }
  for (const FeatureDef& f : t.features) {
    if (static_cast<int32_t>(f.agg) < 0 || static_cast<int32_t>(f.agg) > 8) fail("bad aggregation");
    if (static_cast<int32_t>(f.window) < 0 || static_cast<int32_t>(f.window) > 2) fail("bad window");
    if (f.size < 1 || f.size > (int64_t{1} << 40)) fail("window size out of range");
    if (f.of < -1 || f.of >= c.n_types) fail("feature event type out of range");
    if ((f.agg == Agg::Count) != (f.field < 0) || f.field >= c.n_values) fail("bad feature field");
    if ((f.agg == Agg::Histogram) != !f.edges.empty()) fail("edges are for histograms only");
    if (f.agg == Agg::Histogram) {
      if (f.edges.size() < 2) fail("a histogram needs at least two edges");
      for (size_t i = 0; i < f.edges.size(); ++i) {
        if (!std::isfinite(f.edges[i]) || (i && !(f.edges[i - 1] < f.edges[i]))) {
          fail("histogram edges must be finite and strictly increasing");
        }
      }
    }
  }
}

Compiled compile(const Config& config, const std::vector<TriggerDef>& defs) {
  Compiled out;
  std::vector<GroupId> ids;
  for (const TriggerDef& d : defs) ids.emplace_back(d.generation, d.by);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  out.triggers.resize(defs.size());
  for (const GroupId& id : ids) {
    const auto g = static_cast<int32_t>(out.groups.size());
    out.groups.emplace_back();
    Group& group = out.groups.back();
    group.by = id.second;
    add_edges(group, build_trie(defs, id), config.n_types);
    for (const int32_t t : group.terminals) group.terminal_within.push_back(defs[t].within);
    for (auto* edges : {&group.free_edges, &group.contiguous_edges}) {
      for (Edge& e : *edges) {
        e.term_span = std::numeric_limits<int64_t>::min();
        for (int32_t k = e.term_begin; k < e.term_end; ++k) {
          const int64_t within = group.terminal_within[k];
          const int64_t span = within < 0 ? std::numeric_limits<int64_t>::max() : within;
          e.term_span = std::max(e.term_span, span);
        }
      }
    }
    std::map<std::string, int32_t> first_with;  // features (as bytes) -> first trigger
    for (size_t t = 0; t < defs.size(); ++t) {
      if (!member(defs[t], id)) continue;
      group.live |= !defs[t].removed;
      CompiledTrigger& trigger = out.triggers[t] = compile_features(defs[t], g, group, out.edges);
      trigger.same_features =
          first_with.emplace(features_key(trigger), static_cast<int32_t>(t)).first->second;
    }
    for (size_t t = 0; t < defs.size(); ++t) {
      if (member(defs[t], id)) out.triggers[t].scan = scan_plan(out.triggers[t], group);
    }
    group.logs_by_type.assign(config.n_types, {});
    for (int32_t type = 0; type < config.n_types; ++type) {
      for (size_t i = 0; i < group.logs.size(); ++i) {
        const int32_t of = group.logs[i].of;
        if (of < 0 || of == type) group.logs_by_type[type].push_back(static_cast<int32_t>(i));
      }
    }
    group.window_base = out.n_windows;
    out.n_windows += static_cast<int32_t>(group.windows.size());
  }
  return out;
}

}  // namespace skiff::stream
