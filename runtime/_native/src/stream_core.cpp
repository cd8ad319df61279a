// Engine: configuration, triggers, pushes and their validation, per-key state with
// LRU/TTL eviction, statistics. Matching and firing are in matching.cpp, snapshots in
// engine_snapshot.cpp.
#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>

#include "engine_impl.hpp"

namespace skiff::stream {
namespace {

size_t window_bytes(const WindowState& w) {
  size_t bytes = sizeof(WindowState) + w.bucket_out.capacity() * sizeof(double) +
                 (w.agg.sums.capacity() + w.agg.sqs.capacity()) * sizeof(RunningSum) +
                 w.agg.bins.capacity() * sizeof(int64_t) + w.first_ts.bytes() + w.last_ts.bytes();
  for (const MonoQueue& q : w.extremes) bytes += q.bytes() + sizeof(MonoQueue);
  return bytes;
}

}  // namespace

void Engine::Impl::validate(const Batch& b) const {
  const auto n_values = static_cast<size_t>(config.n_values);
  int64_t wm = watermark;
  // The earliest ts allowed (wm - lateness, without overflow before the first event),
  // and the checks as `&`s of unsigned comparisons: one branch an event.
  int64_t floor = wm == kNone ? 0 : wm - config.lateness;
  const auto n_types = static_cast<uint32_t>(config.n_types);
  // Values first, all in one pass: x - x is 0 for a finite x and NaN otherwise, so the
  // sums are NaN if any value is not finite (four of them: no chain of dependent adds).
  // With none (the rule), the loop below need not look at them.
  double sums[4] = {0, 0, 0, 0};
  const size_t n_all = b.values.size();
  size_t k = 0;
  for (; k + 4 <= n_all; k += 4) {
    for (size_t j = 0; j < 4; ++j) sums[j] += b.values[k + j] - b.values[k + j];
  }
  for (; k < n_all; ++k) sums[0] += b.values[k] - b.values[k];
  const bool all_finite = !std::isnan(sums[0] + sums[1] + sums[2] + sums[3]);
  const size_t check_values = all_finite ? 0 : n_values;
  const double* values = b.values.data();
  if (all_finite) {
    // No branch an event: the checks are and-ed over the batch, and only a batch that
    // fails is walked again (below) for its first bad event.
    const int64_t wm0 = wm, floor0 = floor;
    bool ok = true;
    for (size_t i = 0; i < b.size(); ++i) {
      const int64_t t = b.ts[i];
      ok &= (static_cast<uint32_t>(b.types[i]) < n_types) &
            (static_cast<uint64_t>(t) <= static_cast<uint64_t>(kMaxTs)) & (t >= floor);
      wm = std::max(wm, t);
      floor = std::max(floor, wm - config.lateness);
    }
    if (ok) return;
    wm = wm0;
    floor = floor0;
  }
  for (size_t i = 0; i < b.size(); ++i, values += n_values) {
    const int64_t t = b.ts[i];
    bool finite = true;
    for (size_t v = 0; v < check_values; ++v) finite &= std::isfinite(values[v]);
    const bool ok = (static_cast<uint32_t>(b.types[i]) < n_types) &
                    (static_cast<uint64_t>(t) <= static_cast<uint64_t>(kMaxTs)) & finite &
                    (t >= floor);
    if (!ok) reject(b, i, wm);
    wm = std::max(wm, t);
    floor = std::max(floor, wm - config.lateness);
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

void Engine::Impl::evict(int32_t p) {
  if (ordered) unlink(p);
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
    mark(p);
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
  part.n_last = 0;
  if (part.layout != group || part.block.n_any() != static_cast<size_t>(g.n_any) ||
      part.block.last_room() != static_cast<size_t>(g.max_reached)) {
    part.lay_out(g, group);
  }  // else the slot's block is reused
  std::fill(part.any, part.any + g.n_any, kNone);
  for (KeyLog& log : part.logs) {
    log.arrival.clear();
    log.sorted.clear();
    log.appends = 0;
    log.trim_at = 16;
  }
  reset_windows(g, part.logs, part.windows);
  table.insert(group, key, p);
  part.touched = ++touches;
  part.activity = watermark;
  if (ordered) link_tail(p);
  if (++live > config.max_keys) evict(oldest());  // not p: it is the newest of two or more
  return p;
}

// The live keys' (slot, touch count), least recently used first.
std::vector<Engine::Impl::Touch> Engine::Impl::by_recency() const {
  std::vector<Touch> keys;
  keys.reserve(static_cast<size_t>(live));
  for (size_t p = 0; p < parts.size(); ++p) {
    if (parts[p].group >= 0) keys.push_back(Touch{static_cast<int32_t>(p), parts[p].touched});
  }
  std::sort(keys.begin(), keys.end(), [](const Touch& a, const Touch& b) { return a.touched < b.touched; });
  return keys;
}

// Starts keeping `lru`, from the touch counts so far (the first eviction needs it).
void Engine::Impl::keep_order() {
  for (const Touch& e : by_recency()) link_tail(e.part);
  ordered = true;
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
  size_reads(compiled, window_scratch);
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

Stats Engine::stats() const {
  const Impl& s = *impl_;
  Stats st = s.totals;
  st.live_keys = s.live;
  st.watermark = s.watermark;
  st.state_bytes = static_cast<int64_t>(s.table.bytes());
  for (const Partition& p : s.parts) {
    st.state_bytes += static_cast<int64_t>(sizeof(Partition) + p.block.bytes());
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
