// Engine::snapshot and Engine::restore: the engine's state as bytes (snapshot.hpp has
// the layout) and back.
#include <memory>
#include <string>
#include <utility>

#include "engine_impl.hpp"

namespace skiff::stream {

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
  for (const Touch& e : by_recency()) save_partition(w, parts[e.part], parts[e.part].activity);
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
    load_partition(r, config, compiled.groups[group], group, watermark, part, part.activity);
    if (table.find(group, part.key) >= 0) Reader::fail("a key twice");
    part.group = group;
    reset_windows(compiled.groups[group], part.logs, part.windows);
    const auto p = static_cast<int32_t>(parts.size());
    part.touched = ++touches;  // in the snapshot's order, least recently used first
    parts.push_back(std::move(part));
    lru.emplace_back();
    table.insert(group, parts.back().key, p);
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

}  // namespace skiff::stream
