// The hot path: an event's key state, its trie matches and the firings they make.
#include <algorithm>
#include <utility>

#include "engine_impl.hpp"
#include "features.hpp"
#include "fused_scan.hpp"

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

}  // namespace

void Engine::Impl::apply(const Batch& b, size_t i, Firings& out) {
  const int64_t t = b.ts[i];
  watermark = std::max(watermark, t);
  if (config.ttl >= 0) {
    for (int32_t p = oldest(); p >= 0 && parts[p].activity < watermark - config.ttl; p = oldest()) {
      evict(p);
    }
  }
  const size_t first = out.trigger_id.size();
  for (size_t g = 0; g < compiled.groups.size(); ++g) {
    if (!compiled.groups[g].live) continue;
    const int64_t key = b.keys[i * config.n_keys + compiled.groups[g].by];
    const int32_t p = touch(static_cast<int32_t>(g), key);  // active at the watermark
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
  // In locals: `fire` (out of line) could change any member for all the compiler knows,
  // so each edge would load them again through `this`, `group` and `p`.
  int64_t* const any = p.any;
  const Condition* const conditions = group.conditions.data();
  const int32_t* const terminals = group.terminals.data();
  const int64_t* const terminal_within = group.terminal_within.data();
  const auto holds = [&](const Edge& e) {
    for (int32_t c = e.cond_begin; c < e.cond_end; ++c) {
      const Condition& cond = conditions[c];
      const bool ok = cond.on_value ? compare(cond.cmp, values[cond.field], cond.lit_value)
                                    : compare(cond.cmp, keys[cond.field], cond.lit_key);
      if (!ok) return false;
    }
    return true;
  };
  // A match of the edge's step ends at this event and started at `start`.
  const auto advance = [&](const Edge& e, int64_t start) {
    if (e.child_any >= 0) any[e.child_any] = std::max(any[e.child_any], start);
    if (e.child_last >= 0) reached[n_reached++] = {e.child_last, start};
    if (t - start > e.term_span) return;  // ts are in [0, 2**62]: no overflow
    for (int32_t k = e.term_begin; k < e.term_end; ++k) {
      const int64_t within = terminal_within[k];
      if (within < 0 || start >= t - within) fire(terminals[k], p, t, i, out);
    }
  };
  const Edge* const free_edges = group.free_edges.data();
  const Edge* const free_end = free_edges + group.free_begin[type + 1];
  for (const Edge* e = free_edges + group.free_begin[type]; e != free_end; ++e) {
    const int64_t start = e->parent < 0 ? t : any[e->parent];
    // An edge that only ends triggers does nothing for a match too old for all of them:
    // its conditions need no test.
    if (start == kNone || (t - start > e->term_span && e->child_any < 0 && e->child_last < 0)) continue;
    if (holds(*e)) advance(*e, start);
  }
  // `->`: the parent must have been reached by the key's previous event, so it is a
  // node of that event's type: only those edges are visited.
  const Edge* const edges = group.contiguous_edges.data();
  const Edge* begin = edges + group.contiguous_begin[type];
  const Edge* end = edges + group.contiguous_begin[type + 1];
  if (!group.contiguous_at.empty()) {
    if (p.last_type < 0) {
      end = begin;
    } else {
      const size_t n_types = group.contiguous_begin.size() - 1;
      const int32_t* at = group.contiguous_at.data() + static_cast<size_t>(type) * (n_types + 1) +
                          static_cast<size_t>(p.last_type);
      begin = edges + at[0];
      end = edges + at[1];
    }
  }
  const int32_t last_type = p.last_type;
  const Reached* const last = p.last;
  const Reached* const last_end = last + p.n_last;
  for (const Edge* e = begin; e != end; ++e) {
    if (e->parent_type != last_type) {
      if (e->parent_type > last_type) break;
      continue;
    }
    for (const Reached* r = last; r != last_end; ++r) {
      if (r->first == e->parent) {
        if (holds(*e)) advance(*e, r->second);
        break;
      }
    }
  }
  // The block has room for them: an event reaches at most Group::max_reached nodes.
  std::copy(reached, reached + n_reached, p.last);
  p.n_last = static_cast<int32_t>(n_reached);
  p.last_type = type;
}

void Engine::Impl::fire(int32_t trigger, Partition& p, int64_t ts, size_t index, Firings& out) {
  const CompiledTrigger& trig = compiled.triggers[trigger];
  const int32_t slot = slot_of[trigger] >= 0 ? slot_of[trigger] : matrix_slot(trigger, out);
  std::vector<double>& matrix = out.matrices[slot];
  const size_t base = matrix.size();
  const auto width = static_cast<size_t>(trig.width);
  int64_t lo = 0, hi = 0;
  if (last_row.event == index && last_row.features == trig.same_features) {
    // Through scratch_row: the row copied may be in this very matrix, which may grow.
    const double* row = out.matrices[last_row.slot].data() + last_row.offset;
    if (scratch_row.size() < width) scratch_row.resize(width);
    std::copy(row, row + width, scratch_row.data());
    lo = last_row.lo;
    hi = last_row.hi;
  } else {
    if (scratch_row.size() < width) scratch_row.resize(width);
    const WindowContext ctx{compiled.groups[trig.group], compiled.edges, watermark, config.lateness};
    if (trig.scan.log < 0 ||
        !scan_features(trig, p.logs, config.lateness, ts, scratch_row.data(), lo, hi)) {
      compute_features(trig, ctx, ts, stamp, p.logs, p.windows, window_scratch,
                       scratch_row.data(), lo, hi);
    }
    last_row = {index, trig.same_features, slot, base, lo, hi};
  }
  // push_back, not resize: resize's zero-filling append is an out-of-line call.
  for (size_t k = 0; k < width; ++k) matrix.push_back(scratch_row[k]);
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
// firing rate so far, with some slack) when it first fires (fire looks up the ones
// already added itself).
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

}  // namespace skiff::stream
