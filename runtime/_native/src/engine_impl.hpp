// The engine's state behind Engine (stream_core.hpp): private to the core's sources,
// which split its work by concern: stream_core.cpp (configuration, triggers, pushes,
// validation, per-key state and eviction), matching.cpp (trie matching and firing,
// the hot path) and engine_snapshot.cpp (snapshot and restore).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "compiled.hpp"
#include "partition.hpp"
#include "snapshot.hpp"
#include "stream_core.hpp"
#include "windows.hpp"

namespace skiff::stream {

struct Engine::Impl {
  Config config;
  std::vector<TriggerDef> defs;
  bool dirty = true;            // defs changed since `compiled` was built
  int32_t open_generation = 0;  // generation of triggers added now (0 until the first push)
  Compiled compiled;

  std::vector<Partition> parts;
  std::vector<int32_t> free_parts;
  KeyTable table;
  // LRU order: the live keys by Partition::touched, ascending (the least recently used
  // first). Until an eviction needs it (max_keys reached, or a ttl) it is nowhere else:
  // an event only writes its key's touch count, in the partition line it reads anyway.
  // From then on it is also the list `lru` (links per partition slot, kept apart from
  // the large partitions), so the least recently used key is always at hand. Moving a
  // key to the list's tail reads its links and writes its neighbours': lines of other
  // keys on every event, which an engine that never evicts has no need to pay for.
  struct Touch {
    int32_t part;
    uint64_t touched;
  };
  struct Lru {
    int32_t prev = -1, next = -1;
  };
  uint64_t touches = 0;
  bool ordered = false;  // `lru` is kept (evictions began)
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
  std::vector<double> scratch_row;  // a firing's feature row, before it joins its matrix

  void validate(const Batch& b) const;
  [[noreturn]] void reject(const Batch& b, size_t i, int64_t wm) const;
  void apply(const Batch& b, size_t i, Firings& out);
  int32_t partition(int32_t group, int64_t key);
  // partition() for a key that has state (most events): found and moved to the
  // most-recently-used end here, inline; otherwise the out-of-line call.
  int32_t touch(int32_t group, int64_t key) {
    const int32_t p = table.find(group, key);
    if (p < 0) return partition(group, key);
    mark(p);
    return p;
  }
  // Makes p (a key that has state) the most recently used key, active at the watermark.
  void mark(int32_t p) {
    Partition& part = parts[p];
    part.touched = ++touches;
    part.activity = watermark;
    if (ordered && p != lru_tail) {
      unlink(p);
      link_tail(p);
    }
  }
  void unlink(int32_t p) {
    const int32_t prev = lru[p].prev, next = lru[p].next;
    (prev >= 0 ? lru[prev].next : lru_head) = next;
    (next >= 0 ? lru[next].prev : lru_tail) = prev;
    lru[p].prev = lru[p].next = -1;
  }
  void link_tail(int32_t p) {
    lru[p].prev = lru_tail;
    lru[p].next = -1;
    (lru_tail >= 0 ? lru[lru_tail].next : lru_head) = p;
    lru_tail = p;
  }
  // The least recently used key, or -1 if none.
  int32_t oldest() {
    if (!ordered) keep_order();
    return lru_head;
  }
  std::vector<Touch> by_recency() const;
  void keep_order();
  void evict(int32_t p);
  void process(const Batch& b, size_t i, int32_t g, Partition& p, Firings& out);
  void reserve(size_t events, Firings& out);
  void recompile();
  void save(Writer& w) const;
  void load(Reader& r);
  int32_t matrix_slot(int32_t trigger, Firings& out);
  void fire(int32_t trigger, Partition& p, int64_t ts, size_t index, Firings& out);
};

}  // namespace skiff::stream
