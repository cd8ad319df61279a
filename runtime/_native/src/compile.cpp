// Builds the per-partition-field tries and log layouts from the registered triggers.
#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <tuple>

#include "compiled.hpp"

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

std::vector<Node> build_trie(const std::vector<TriggerDef>& defs, int32_t by) {
  std::vector<Node> nodes;
  std::map<std::string, int32_t> index;
  for (size_t t = 0; t < defs.size(); ++t) {
    if (defs[t].by != by) continue;
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
    nodes[parent].terminals.push_back(static_cast<int32_t>(t));
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
  // (type, sort key, edge): the sort key is -depth for free edges, the parent's type for
  // `->` ones; ties keep trie order.
  std::vector<std::tuple<int32_t, int32_t, size_t, Edge>> free, contiguous;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    const bool root = n.parent < 0;
    const bool gap = !root && n.op == Op::Gap;
    const int32_t parent_type = root ? -1 : nodes[n.parent].type;
    Edge e{root ? -1 : gap ? slot[n.parent] : n.parent, parent_type, slot[i],
           n.contiguous_children ? static_cast<int32_t>(i) : -1, 0, 0, 0, 0};
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
}

int32_t log_for(Group& group, int32_t of) {
  for (size_t i = 0; i < group.logs.size(); ++i) {
    if (group.logs[i].of == of) return static_cast<int32_t>(i);
  }
  group.logs.push_back(LogSpec{of, {}, 0, -1});
  return static_cast<int32_t>(group.logs.size() - 1);
}

int32_t column_for(LogSpec& log, int32_t field) {
  if (field < 0) return -1;
  const auto it = std::find(log.columns.begin(), log.columns.end(), field);
  if (it != log.columns.end()) return static_cast<int32_t>(it - log.columns.begin());
  log.columns.push_back(field);
  return static_cast<int32_t>(log.columns.size() - 1);
}

CompiledTrigger compile_features(const TriggerDef& def, int32_t group_index, Group& group,
                                 std::vector<double>& edges) {
  CompiledTrigger out{group_index, def.within, 0, -1, {}};
  for (const FeatureDef& f : def.features) {
    const int32_t log = log_for(group, f.of);
    LogSpec& spec = group.logs[log];
    CompiledFeature cf{f.agg, f.window, f.size, log, column_for(spec, f.field), 0, 0, out.width};
    if (f.window == WindowKind::Count) {
      spec.keep = std::max(spec.keep, f.size);
    } else {
      spec.reach = std::max(spec.reach, f.window == WindowKind::Sliding ? f.size : 2 * f.size);
    }
    cf.edges_begin = static_cast<int32_t>(edges.size());
    edges.insert(edges.end(), f.edges.begin(), f.edges.end());
    cf.edges_end = static_cast<int32_t>(edges.size());
    out.width += f.agg == Agg::Histogram ? static_cast<int32_t>(f.edges.size()) - 1 : 1;
    out.features.push_back(cf);
  }
  return out;
}

std::string features_key(const CompiledTrigger& trigger, const std::vector<double>& edges) {
  std::string key;
  for (const CompiledFeature& f : trigger.features) {
    append_bytes(key, f.agg);
    append_bytes(key, f.window);
    append_bytes(key, f.size);
    append_bytes(key, f.log);
    append_bytes(key, f.column);
    append_bytes(key, f.edges_end - f.edges_begin);
    for (int32_t e = f.edges_begin; e < f.edges_end; ++e) append_bytes(key, edges[e]);
  }
  return key;
}

}  // namespace

Compiled compile(const Config& config, const std::vector<TriggerDef>& defs) {
  Compiled out;
  std::vector<int32_t> bys;
  for (const TriggerDef& d : defs) bys.push_back(d.by);
  std::sort(bys.begin(), bys.end());
  bys.erase(std::unique(bys.begin(), bys.end()), bys.end());
  out.triggers.resize(defs.size());
  for (const int32_t by : bys) {
    const auto g = static_cast<int32_t>(out.groups.size());
    out.groups.emplace_back();
    Group& group = out.groups.back();
    group.by = by;
    add_edges(group, build_trie(defs, by), config.n_types);
    for (const int32_t t : group.terminals) group.terminal_within.push_back(defs[t].within);
    for (size_t t = 0; t < defs.size(); ++t) {
      if (defs[t].by == by) out.triggers[t] = compile_features(defs[t], g, group, out.edges);
    }
    std::map<std::string, int32_t> first_with;  // features (as bytes) -> first trigger
    for (size_t t = 0; t < defs.size(); ++t) {
      if (defs[t].by != by) continue;
      CompiledTrigger& trigger = out.triggers[t];
      trigger.same_features =
          first_with.emplace(features_key(trigger, out.edges), static_cast<int32_t>(t)).first->second;
    }
    group.logs_by_type.assign(config.n_types, {});
    for (int32_t type = 0; type < config.n_types; ++type) {
      for (size_t i = 0; i < group.logs.size(); ++i) {
        const int32_t of = group.logs[i].of;
        if (of < 0 || of == type) group.logs_by_type[type].push_back(static_cast<int32_t>(i));
      }
    }
  }
  return out;
}

}  // namespace skiff::stream
