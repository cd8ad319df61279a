// Engine: validation, per-key state with LRU/TTL eviction, trie matching, firing.
#include "stream_core.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>

#include "compiled.hpp"
#include "features.hpp"

namespace skiff::stream {
namespace {

struct Partition {
  int32_t group = -1;
  int32_t layout = -1;           // group whose log layout `logs` has (slots are reused)
  int32_t last_type = -1;        // type of the key's latest event, -1 before the first
  int64_t key = 0;
  std::vector<int64_t> any;      // per `~>`-parent node: latest start of a match so far
  std::vector<std::pair<int32_t, int64_t>> last;  // (node, start) reached by latest event
  std::vector<EventLog> logs;
};

// Key fields compare as int64, value fields as double.
template <typename T>
bool compare(Cmp cmp, T a, T b) {
  switch (cmp) {
    case Cmp::Eq: return a == b;
    case Cmp::Ne: return a != b;
    case Cmp::Lt: return a < b;
    case Cmp::Le: return a <= b;
    case Cmp::Gt: return a > b;
    case Cmp::Ge: return a >= b;
  }
  return false;
}

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

}  // namespace

struct Engine::Impl {
  Config config;
  std::vector<TriggerDef> defs;
  bool frozen = false;
  Compiled compiled;

  std::vector<Partition> parts;
  std::vector<int32_t> free_parts;
  KeyTable table;
  // LRU list and idle clock per partition slot, kept apart from the (large) partitions
  // so moving a key to the tail touches three small arrays, not three partitions.
  std::vector<int32_t> lru_prev, lru_next;
  std::vector<int64_t> activity;  // watermark after the key's latest event
  int32_t lru_head = -1, lru_tail = -1;
  int64_t live = 0;

  int64_t watermark = kNone;
  Stats totals;
  std::vector<double> scratch;
  // The latest computed feature row: (event index, CompiledTrigger::same_features) and
  // where it is, so other triggers firing with the same features at that event copy it.
  struct {
    size_t event = SIZE_MAX;
    int32_t features = -1, trigger = -1;
    size_t offset = 0;
    int64_t lo = 0, hi = 0;
  } last_row;
  std::vector<int64_t> fired;  // firings per trigger so far, to size the outputs
  std::vector<std::pair<int32_t, int64_t>> scratch_last;

  void validate(const Batch& b) const;
  [[noreturn]] void reject(const Batch& b, size_t i, int64_t wm) const;
  void apply(const Batch& b, size_t i, Firings& out);
  int32_t partition(int32_t group, int64_t key);
  void unlink(int32_t p);
  void link_tail(int32_t p);
  void evict(int32_t p);
  void process(const Batch& b, size_t i, int32_t g, Partition& p, Firings& out);
  void reserve(size_t events, Firings& out);
  void fire(int32_t trigger, const Partition& p, int64_t ts, size_t index, Firings& out);
};

void Engine::Impl::validate(const Batch& b) const {
  const auto n_values = static_cast<size_t>(config.n_values);
  int64_t wm = watermark;
  for (size_t i = 0; i < b.size(); ++i) {
    const int64_t t = b.ts[i];
    bool finite = true;
    for (size_t v = 0; v < n_values; ++v) finite &= std::isfinite(b.values[i * n_values + v]);
    const bool ok = b.types[i] >= 0 && b.types[i] < config.n_types && t >= 0 && t <= kMaxTs &&
                    finite && (wm == kNone || t >= wm - config.lateness);
    if (!ok) reject(b, i, wm);
    wm = std::max(wm, t);
  }
}

// Throws the InputError for event i (known bad), naming the first problem found.
void Engine::Impl::reject(const Batch& b, size_t i, int64_t wm) const {
  const auto n_values = static_cast<size_t>(config.n_values);
  const int64_t t = b.ts[i];
  std::ostringstream msg;
  msg << "event " << i << ": ";
  if (b.types[i] < 0 || b.types[i] >= config.n_types) {
    msg << "type code " << b.types[i] << " is not one of the " << config.n_types << " event types";
    throw InputError(InputError::Kind::UnknownType, i, msg.str());
  }
  if (t < 0 || t > kMaxTs) {
    msg << "timestamp " << t << " is outside [0, 2**62]";
    throw InputError(InputError::Kind::TimestampRange, i, msg.str());
  }
  for (size_t v = 0; v < n_values; ++v) {
    const double x = b.values[i * n_values + v];
    if (!std::isfinite(x)) {
      msg << "value '" << config.value_names[v] << "' is "
          << (std::isnan(x) ? "nan" : x > 0 ? "inf" : "-inf") << " (values must be finite)";
      throw InputError(InputError::Kind::NonFinite, i, msg.str());
    }
  }
  msg << "timestamp " << t << " is " << (wm - t) << " ms behind the watermark " << wm
      << ", beyond the allowed lateness of " << config.lateness << " ms";
  throw InputError(InputError::Kind::Late, i, msg.str());
}

void Engine::Impl::unlink(int32_t p) {
  const int32_t prev = lru_prev[p], next = lru_next[p];
  (prev >= 0 ? lru_next[prev] : lru_head) = next;
  (next >= 0 ? lru_prev[next] : lru_tail) = prev;
  lru_prev[p] = lru_next[p] = -1;
}

void Engine::Impl::link_tail(int32_t p) {
  lru_prev[p] = lru_tail;
  lru_next[p] = -1;
  (lru_tail >= 0 ? lru_next[lru_tail] : lru_head) = p;
  lru_tail = p;
}

void Engine::Impl::evict(int32_t p) {
  unlink(p);
  table.erase(parts[p].group, parts[p].key);
  parts[p].group = -1;
  free_parts.push_back(p);
  --live;
  ++totals.evicted_keys;
}

// The key's state, created (evicting the least recently used key past max_keys) if
// absent, and moved to the most-recently-used end.
int32_t Engine::Impl::partition(int32_t group, int64_t key) {
  int32_t p = table.find(group, key);
  if (p >= 0) {
    if (p != lru_tail) {
      unlink(p);
      link_tail(p);
    }
    return p;
  }
  if (free_parts.empty()) {
    p = static_cast<int32_t>(parts.size());
    parts.emplace_back();
    lru_prev.push_back(-1);
    lru_next.push_back(-1);
    activity.push_back(0);
  } else {
    p = free_parts.back();
    free_parts.pop_back();
  }
  const Group& g = compiled.groups[group];
  Partition& part = parts[p];
  part.group = group;
  part.key = key;
  part.last_type = -1;
  part.any.assign(g.n_any, kNone);  // reuses the slot's memory
  part.last.clear();
  if (part.layout != group) {
    part.logs.clear();
    for (const LogSpec& spec : g.logs) part.logs.emplace_back(spec.columns.size());
    part.layout = group;
  }
  for (EventLog& log : part.logs) log.clear();
  table.insert(group, key, p);
  link_tail(p);
  if (++live > config.max_keys) evict(lru_head);
  return p;
}

void Engine::Impl::apply(const Batch& b, size_t i, Firings& out) {
  const int64_t t = b.ts[i];
  watermark = std::max(watermark, t);
  if (config.ttl >= 0) {
    while (lru_head >= 0 && activity[lru_head] < watermark - config.ttl) evict(lru_head);
  }
  const size_t first = out.trigger_id.size();
  for (size_t g = 0; g < compiled.groups.size(); ++g) {
    const int64_t key = b.keys[i * config.n_keys + compiled.groups[g].by];
    const int32_t p = partition(static_cast<int32_t>(g), key);
    activity[p] = watermark;
    process(b, i, static_cast<int32_t>(g), parts[p], out);
  }
  // Firings of one event leave in trigger id order (insertion sort: a handful at most).
  for (size_t j = first + 1; j < out.trigger_id.size(); ++j) {
    for (size_t k = j; k > first && out.trigger_id[k - 1] > out.trigger_id[k]; --k) {
      std::swap(out.trigger_id[k - 1], out.trigger_id[k]);
      std::swap(out.key[k - 1], out.key[k]);
      std::swap(out.window_start[k - 1], out.window_start[k]);
      std::swap(out.window_end[k - 1], out.window_end[k]);
      std::swap(out.row[k - 1], out.row[k]);
    }
  }
  ++totals.events;
}

void Engine::Impl::process(const Batch& b, size_t i, int32_t g, Partition& p, Firings& out) {
  const Group& group = compiled.groups[g];
  const int32_t type = b.types[i];
  const int64_t t = b.ts[i];
  const double* values = b.values.data() + i * config.n_values;
  const int64_t* keys = b.keys.data() + i * config.n_keys;
  for (const int32_t l : group.logs_by_type[type]) {
    const LogSpec& spec = group.logs[l];
    EventLog& log = p.logs[l];
    log.push(t, values, spec.columns.data());
    const int64_t horizon = spec.reach < 0 ? kMaxTs + 1 : watermark - config.lateness - spec.reach;
    log.evict(horizon, static_cast<size_t>(spec.keep));
  }
  std::vector<std::pair<int32_t, int64_t>>& reached = scratch_last;
  reached.clear();
  const auto holds = [&](const Edge& e) {
    for (int32_t c = e.cond_begin; c < e.cond_end; ++c) {
      const Condition& cond = group.conditions[c];
      const bool ok = cond.on_value ? compare(cond.cmp, values[cond.field], cond.lit_value)
                                    : compare(cond.cmp, keys[cond.field], cond.lit_key);
      if (!ok) return false;
    }
    return true;
  };
  // A match of the edge's step ends at this event and started at `start`.
  const auto advance = [&](const Edge& e, int64_t start) {
    if (e.child_any >= 0) p.any[e.child_any] = std::max(p.any[e.child_any], start);
    if (e.child_last >= 0) reached.emplace_back(e.child_last, start);
    for (int32_t k = e.term_begin; k < e.term_end; ++k) {
      const int64_t within = group.terminal_within[k];
      if (within < 0 || start >= t - within) fire(group.terminals[k], p, t, i, out);
    }
  };
  const Edge* edges = group.free_edges.data();
  for (int32_t j = group.free_begin[type]; j < group.free_begin[type + 1]; ++j) {
    const Edge& e = edges[j];
    const int64_t start = e.parent < 0 ? t : p.any[e.parent];
    if (start != kNone && holds(e)) advance(e, start);
  }
  // `->`: the parent must have been reached by the key's previous event, so it is a
  // node of that event's type: only those edges are visited.
  edges = group.contiguous_edges.data();
  const Edge* end = edges + group.contiguous_begin[type + 1];
  for (const Edge* e = edges + group.contiguous_begin[type]; e != end; ++e) {
    if (e->parent_type != p.last_type) {
      if (e->parent_type > p.last_type) break;
      continue;
    }
    for (const auto& [node, from] : p.last) {
      if (node == e->parent) {
        if (holds(*e)) advance(*e, from);
        break;
      }
    }
  }
  p.last.swap(reached);
  p.last_type = type;
}

void Engine::Impl::fire(int32_t trigger, const Partition& p, int64_t ts, size_t index, Firings& out) {
  const CompiledTrigger& trig = compiled.triggers[trigger];
  std::vector<double>& matrix = out.features[trigger];
  const size_t base = matrix.size();
  matrix.resize(base + trig.width);
  int64_t lo = 0, hi = 0;
  if (last_row.event == index && last_row.features == trig.same_features) {
    const double* row = out.features[last_row.trigger].data() + last_row.offset;
    std::copy(row, row + trig.width, matrix.data() + base);
    lo = last_row.lo;
    hi = last_row.hi;
  } else {
    compute_features(trig, p.logs, compiled.edges, ts, config.lateness, matrix.data() + base, lo,
                     hi, scratch);
    last_row = {index, trig.same_features, trigger, base, lo, hi};
  }
  ++fired[trigger];
  out.trigger_id.push_back(trigger);
  out.key.push_back(p.key);
  out.ts.push_back(ts);
  out.event_index.push_back(static_cast<int64_t>(index));
  out.window_start.push_back(lo);
  out.window_end.push_back(hi);
  out.row.push_back(out.rows[trigger]++);
  ++totals.firings;
}

// Sizes the outputs for a batch of `events` from the firing rates so far (with some
// slack), so appending a firing rarely reallocates and copies them.
void Engine::Impl::reserve(size_t events, Firings& out) {
  fired.resize(defs.size());
  if (totals.events == 0) return;
  const double per_event = static_cast<double>(events) / static_cast<double>(totals.events);
  const auto expect = [&](int64_t so_far) {
    return static_cast<size_t>(1.1 * per_event * static_cast<double>(so_far)) + 16;
  };
  const size_t n = expect(totals.firings);
  for (auto* column : {&out.key, &out.ts, &out.event_index, &out.window_start, &out.window_end,
                       &out.row}) {
    column->reserve(n);
  }
  out.trigger_id.reserve(n);
  for (size_t t = 0; t < defs.size(); ++t) {
    if (fired[t] > 0) out.features[t].reserve(expect(fired[t]) * compiled.triggers[t].width);
  }
}

Engine::Engine(Config config) : impl_(std::make_unique<Impl>()) {
  if (config.n_types < 1 || config.n_keys < 0 || config.n_values < 0 || config.lateness < 0 ||
      config.max_keys < 1 || static_cast<int32_t>(config.value_names.size()) != config.n_values) {
    throw std::invalid_argument("invalid stream engine configuration");
  }
  impl_->config = std::move(config);
}

Engine::~Engine() = default;

int32_t Engine::add_trigger(const TriggerDef& trigger) {
  if (impl_->frozen) throw StateError("triggers must be added before the first push");
  check_trigger(impl_->config, trigger);
  impl_->defs.push_back(trigger);
  return static_cast<int32_t>(impl_->defs.size() - 1);
}

int32_t Engine::trigger_count() const { return static_cast<int32_t>(impl_->defs.size()); }

int32_t Engine::trigger_width(int32_t trigger) const {
  int32_t width = 0;
  for (const FeatureDef& f : impl_->defs.at(trigger).features) {
    width += f.agg == Agg::Histogram ? static_cast<int32_t>(f.edges.size()) - 1 : 1;
  }
  return width;
}

void Engine::push(const Batch& batch, Firings& out) {
  Impl& s = *impl_;
  if (batch.types.size() != batch.size() ||
      batch.keys.size() != batch.size() * static_cast<size_t>(s.config.n_keys) ||
      batch.values.size() != batch.size() * static_cast<size_t>(s.config.n_values)) {
    throw std::invalid_argument("batch arrays disagree on the number of events");
  }
  if (!s.frozen) {
    s.compiled = compile(s.config, s.defs);
    s.frozen = true;
  }
  s.validate(batch);  // throws before anything is applied
  out.features.assign(s.defs.size(), {});
  out.rows.assign(s.defs.size(), 0);
  s.last_row.event = SIZE_MAX;
  s.reserve(batch.size(), out);
  for (size_t i = 0; i < batch.size(); ++i) s.apply(batch, i, out);
}

Stats Engine::stats() const {
  const Impl& s = *impl_;
  Stats st = s.totals;
  st.live_keys = s.live;
  st.watermark = s.watermark;
  st.state_bytes = static_cast<int64_t>(s.table.bytes());
  for (const Partition& p : s.parts) {
    st.state_bytes += static_cast<int64_t>(sizeof(Partition) + p.any.capacity() * sizeof(int64_t) +
                                           p.last.capacity() * sizeof(p.last[0]));
    for (const EventLog& log : p.logs) {
      st.state_bytes += static_cast<int64_t>(log.bytes());
      if (p.group >= 0) st.live_events += static_cast<int64_t>(log.size());
    }
  }
  for (const Group& g : s.compiled.groups) st.trie_nodes += g.n_nodes;
  return st;
}

}  // namespace skiff::stream
