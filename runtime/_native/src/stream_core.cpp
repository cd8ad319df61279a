// Engine: validation, per-key state with LRU/TTL eviction, trie matching, firing.
#include "stream_core.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>

#include "compiled.hpp"
#include "features.hpp"
#include "partition.hpp"
#include "snapshot.hpp"
#include "windows.hpp"

namespace skiff::stream {
namespace {

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

size_t window_bytes(const WindowState& w) {
  size_t bytes = sizeof(WindowState) + w.bucket_out.capacity() * sizeof(double) +
                 (w.agg.sums.capacity() + w.agg.sqs.capacity()) * sizeof(RunningSum) +
                 w.agg.bins.capacity() * sizeof(int64_t) + w.first_ts.bytes() + w.last_ts.bytes();
  for (const MonoQueue& q : w.extremes) bytes += q.bytes() + sizeof(MonoQueue);
  return bytes;
}

}  // namespace

struct Engine::Impl {
  Config config;
  std::vector<TriggerDef> defs;
  bool dirty = true;            // defs changed since `compiled` was built
  int32_t open_generation = 0;  // generation of triggers added now (0 until the first push)
  Compiled compiled;

  std::vector<Partition> parts;
  std::vector<int32_t> free_parts;
  KeyTable table;
  // LRU list and idle clock per partition slot, kept apart from the (large) partitions
  // so moving a key to the tail touches one small array, not three partitions; one
  // 16-byte entry per slot, so a key's links and clock are one cache line, not three.
  struct Lru {
    int32_t prev = -1, next = -1;
    int64_t activity = 0;  // watermark after the key's latest event
  };
  std::vector<Lru> lru;
  int32_t lru_head = -1, lru_tail = -1;
  int64_t live = 0;

  int64_t watermark = kNone;
  Stats totals;
  WindowScratch window_scratch;
  uint64_t stamp = 0;
  // The latest computed feature row: (event index, CompiledTrigger::same_features) and
  // where it is, so other triggers firing with the same features at that event copy it.
  struct {
    size_t event = SIZE_MAX;
    int32_t features = -1, slot = -1;
    size_t offset = 0;
    int64_t lo = 0, hi = 0;
  } last_row;
  std::vector<int64_t> fired;    // firings per trigger so far, to size the outputs
  std::vector<int32_t> slot_of;  // per trigger: its entry in Firings::fired this push, or -1
  double per_event = 0;          // expected firings per event of this push (for reserving)
  size_t batch_events = 0;       // events in this push
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
  void recompile();
  void clear_keys();
  void save(Writer& w) const;
  void load(Reader& r);
  int32_t matrix_slot(int32_t trigger, Firings& out);
  void fire(int32_t trigger, Partition& p, int64_t ts, size_t index, Firings& out);
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
  const int32_t prev = lru[p].prev, next = lru[p].next;
  (prev >= 0 ? lru[prev].next : lru_head) = next;
  (next >= 0 ? lru[next].prev : lru_tail) = prev;
  lru[p].prev = lru[p].next = -1;
}

void Engine::Impl::link_tail(int32_t p) {
  lru[p].prev = lru_tail;
  lru[p].next = -1;
  (lru_tail >= 0 ? lru[lru_tail].next : lru_head) = p;
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
    lru.emplace_back();
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
  for (KeyLog& log : part.logs) {
    log.arrival.clear();
    log.sorted.clear();
    log.appends = 0;
    log.trim_at = 16;
  }
  reset_windows(g, part.logs, part.windows);
  table.insert(group, key, p);
  link_tail(p);
  if (++live > config.max_keys) evict(lru_head);
  return p;
}

void Engine::Impl::apply(const Batch& b, size_t i, Firings& out) {
  const int64_t t = b.ts[i];
  watermark = std::max(watermark, t);
  if (config.ttl >= 0) {
    while (lru_head >= 0 && lru[lru_head].activity < watermark - config.ttl) evict(lru_head);
  }
  const size_t first = out.trigger_id.size();
  for (size_t g = 0; g < compiled.groups.size(); ++g) {
    if (!compiled.groups[g].live) continue;
    const int64_t key = b.keys[i * config.n_keys + compiled.groups[g].by];
    const int32_t p = partition(static_cast<int32_t>(g), key);
    lru[p].activity = watermark;
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
  const WindowContext ctx{group, compiled.edges, watermark, config.lateness};
  for (const int32_t l : group.logs_by_type[type]) append_row(ctx, l, t, values, p.logs, p.windows);
  ++stamp;  // window outputs computed from here on are this event's (for this key)
  // Nodes this event reached, written in place (room for every node was made when the
  // triggers were compiled: one event reaches a node through one edge at most).
  std::pair<int32_t, int64_t>* reached = scratch_last.data();
  size_t n_reached = 0;
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
    if (e.child_last >= 0) reached[n_reached++] = {e.child_last, start};
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
  p.last.assign(reached, reached + n_reached);  // no allocation once the key's is grown
  p.last_type = type;
}

void Engine::Impl::fire(int32_t trigger, Partition& p, int64_t ts, size_t index, Firings& out) {
  const CompiledTrigger& trig = compiled.triggers[trigger];
  const int32_t slot = matrix_slot(trigger, out);
  std::vector<double>& matrix = out.matrices[slot];
  const size_t base = matrix.size();
  matrix.resize(base + trig.width);
  int64_t lo = 0, hi = 0;
  if (last_row.event == index && last_row.features == trig.same_features) {
    const double* row = out.matrices[last_row.slot].data() + last_row.offset;
    std::copy(row, row + trig.width, matrix.data() + base);
    lo = last_row.lo;
    hi = last_row.hi;
  } else {
    const WindowContext ctx{compiled.groups[trig.group], compiled.edges, watermark, config.lateness};
    compute_features(trig, ctx, ts, stamp, p.logs, p.windows, window_scratch,
                     matrix.data() + base, lo, hi);
    last_row = {index, trig.same_features, slot, base, lo, hi};
  }
  ++fired[trigger];
  out.trigger_id.push_back(trigger);
  out.key.push_back(p.key);
  out.ts.push_back(ts);
  out.event_index.push_back(static_cast<int64_t>(index));
  out.window_start.push_back(lo);
  out.window_end.push_back(hi);
  out.row.push_back(out.rows[slot]++);
  ++totals.firings;
}

// The trigger's matrix in this push's output, added (and sized from the trigger's
// firing rate so far, with some slack) when it first fires.
int32_t Engine::Impl::matrix_slot(int32_t trigger, Firings& out) {
  int32_t& slot = slot_of[trigger];
  if (slot < 0) {
    slot = static_cast<int32_t>(out.fired.size());
    out.fired.push_back(trigger);
    out.rows.push_back(0);
    out.matrices.emplace_back();
    // Capped at one row per event of the push (see `reserve`).
    const double rate = 1.1 * per_event * static_cast<double>(fired[trigger]);
    const auto expect = static_cast<size_t>(std::min(rate, static_cast<double>(batch_events)));
    out.matrices.back().reserve((expect + 4) * static_cast<size_t>(compiled.triggers[trigger].width));
  }
  return slot;
}

// Sizes the firing columns for a batch of `events` from the firing rate so far (with
// some slack), so appending a firing rarely reallocates and copies them. Only O(1)
// work: a push must cost nothing per registered trigger.
void Engine::Impl::reserve(size_t events, Firings& out) {
  fired.resize(defs.size());
  slot_of.resize(defs.size(), -1);
  batch_events = events;
  per_event = totals.events ? static_cast<double>(events) / static_cast<double>(totals.events) : 0;
  if (totals.events == 0) return;
  // Capped at what the batch can fire: counters restored from a snapshot that was
  // damaged (and resealed) must not ask for terabytes.
  const double most = static_cast<double>(events) * static_cast<double>(defs.size());
  const double expect = 1.1 * per_event * static_cast<double>(totals.firings);
  const size_t n = static_cast<size_t>(std::min(expect, most)) + 16;
  for (auto* column : {&out.key, &out.ts, &out.event_index, &out.window_start, &out.window_end,
                       &out.row}) {
    column->reserve(n);
  }
  out.trigger_id.reserve(n);
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
  check_trigger(impl_->config, trigger);
  impl_->defs.push_back(trigger);
  impl_->defs.back().generation = impl_->open_generation;
  impl_->defs.back().removed = false;
  impl_->dirty = true;
  return static_cast<int32_t>(impl_->defs.size() - 1);
}

void Engine::remove_trigger(int32_t trigger) {
  if (trigger < 0 || trigger >= trigger_count() || impl_->defs[trigger].removed) {
    throw StateError("no trigger " + std::to_string(trigger) + " to remove");
  }
  impl_->defs[trigger].removed = true;
  impl_->dirty = true;
}

// Builds the tries again after triggers came or went. Groups are ordered by generation,
// and a generation's triggers never change after it was compiled (only their `removed`
// flags, which leave the layout as it was), so every existing key's group index and
// state layout stay valid. Keys of groups left with no live trigger are dropped.
void Engine::Impl::recompile() {
  compiled = compile(config, defs);
  dirty = false;
  size_t nodes = 0;
  for (const Group& g : compiled.groups) nodes = std::max(nodes, static_cast<size_t>(g.n_nodes));
  scratch_last.resize(nodes);
  int32_t top = -1;
  for (const TriggerDef& d : defs) top = std::max(top, d.generation);
  open_generation = top + 1;
  for (size_t p = 0; p < parts.size(); ++p) {
    const int32_t g = parts[p].group;
    if (g >= 0 && !compiled.groups[g].live) {
      evict(static_cast<int32_t>(p));
      --totals.evicted_keys;  // not an eviction by the limits: the triggers went away
    }
  }
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
  if (s.dirty) s.recompile();
  s.validate(batch);  // throws before anything is applied
  out.fired.clear();
  out.matrices.clear();
  out.rows.clear();
  s.last_row.event = SIZE_MAX;
  s.reserve(batch.size(), out);
  for (size_t i = 0; i < batch.size(); ++i) s.apply(batch, i, out);
  for (const int32_t t : out.fired) s.slot_of[t] = -1;
}

void Engine::Impl::save(Writer& w) const {
  w.put<uint32_t>(kByteOrderMarker);
  for (const int64_t x : {watermark, totals.events, totals.firings, totals.evicted_keys}) w.put(x);
  w.put<uint64_t>(defs.size());
  for (size_t t = 0; t < defs.size(); ++t) {
    w.put<int32_t>(defs[t].generation);
    w.put<uint8_t>(defs[t].removed);
    w.put<int64_t>(t < fired.size() ? fired[t] : 0);
  }
  w.put<uint64_t>(static_cast<uint64_t>(live));
  for (int32_t p = lru_head; p >= 0; p = lru[p].next) save_partition(w, parts[p], lru[p].activity);
}

// Reads a snapshot into this fresh state (config and defs set, no keys yet).
void Engine::Impl::load(Reader& r) {
  if (r.get<uint32_t>() != kByteOrderMarker) Reader::fail("written on a host of another byte order");
  watermark = r.get<int64_t>();
  for (int64_t* x : {&totals.events, &totals.firings, &totals.evicted_keys}) {
    *x = r.get<int64_t>();
    if (*x < 0) Reader::fail("negative counter");
  }
  if (watermark != kNone && (watermark < 0 || watermark > kMaxTs)) Reader::fail("bad watermark");
  const size_t n = r.count(sizeof(int32_t) + sizeof(uint8_t) + sizeof(int64_t));
  if (n != defs.size()) {
    Reader::fail("has " + std::to_string(n) + " triggers, the engine " + std::to_string(defs.size()));
  }
  fired.assign(n, 0);
  for (size_t t = 0, previous = 0; t < n; ++t) {
    const auto generation = r.get<int32_t>();
    const auto removed = r.get<uint8_t>();
    fired[t] = r.get<int64_t>();
    // One new generation at most per trigger, in id order.
    if (generation < static_cast<int64_t>(previous) || static_cast<size_t>(generation) > t) Reader::fail("bad generations");
    if (removed > 1 || (removed == 1) != defs[t].removed) Reader::fail("removed triggers differ");
    if (fired[t] < 0) Reader::fail("negative counter");
    defs[t].generation = generation;
    previous = static_cast<size_t>(generation);
  }
  recompile();
  const size_t n_keys = r.count(2 * sizeof(int32_t) + 4 * sizeof(int64_t));
  if (static_cast<int64_t>(n_keys) > config.max_keys || (n_keys && watermark == kNone)) Reader::fail("bad key count");
  for (size_t i = 0; i < n_keys; ++i) {
    const auto group = r.get<int32_t>();
    if (group < 0 || static_cast<size_t>(group) >= compiled.groups.size() || !compiled.groups[group].live) {
      Reader::fail("bad group");
    }
    Partition part;
    int64_t idle = 0;
    load_partition(r, config, compiled.groups[group], watermark, part, idle);
    if (table.find(group, part.key) >= 0) Reader::fail("a key twice");
    part.group = part.layout = group;
    reset_windows(compiled.groups[group], part.logs, part.windows);
    const auto p = static_cast<int32_t>(parts.size());
    parts.push_back(std::move(part));
    lru.push_back(Lru{-1, -1, idle});
    table.insert(group, parts.back().key, p);
    link_tail(p);
    ++live;
  }
  if (!r.done()) Reader::fail("trailing bytes");
}

std::string Engine::snapshot() const {
  Writer w;
  impl_->save(w);
  return std::move(w.out);
}

void Engine::restore(const std::string& payload) {
  auto next = std::make_unique<Impl>();
  next->config = impl_->config;
  next->defs = impl_->defs;
  Reader r(payload);
  next->load(r);  // throws SnapshotError, leaving this engine as it was
  impl_ = std::move(next);
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
    for (const KeyLog& log : p.logs) {
      const EventLog &arrival = log.arrival, &sorted = log.sorted;
      st.state_bytes += static_cast<int64_t>(arrival.bytes() + sorted.bytes());
      // A row in both orders is one event (count windows keep the newest rows).
      if (p.group >= 0) st.live_events += static_cast<int64_t>(std::max(arrival.size(), sorted.size()));
    }
    for (const WindowState& w : p.windows) st.state_bytes += static_cast<int64_t>(window_bytes(w));
  }
  for (const Group& g : s.compiled.groups) st.trie_nodes += g.n_nodes;
  return st;
}

}  // namespace skiff::stream
