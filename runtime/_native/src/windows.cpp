// Per-key window state kept up to date (running aggregates, min/max queues, cached
// buckets), the logs' upkeep, and which way each window is read (windows.hpp).
#include "windows.hpp"

#include <algorithm>
#include <cmath>

#include "window_scan.hpp"
#include "window_stats.hpp"

namespace skiff::stream {
namespace {

// Adds a row to the aggregates and (as the newest) to the min/max queues.
void enter(const WindowContext& ctx, const WindowSpec& w, WindowState& s, const EventLog& log,
           int64_t pos) {
  const int64_t* row = log.row(pos);
  apply_row(w, ctx.edges, row, 1, s.agg);
  for (size_t k = 0; k < w.extremes.size(); ++k) {
    const auto [column, is_max] = w.extremes[k];
    s.extremes[k].push({pos, row[0], EventLog::value(row, static_cast<size_t>(column))},
                       [is_max](const MonoQueue::Entry& e, const MonoQueue::Entry& back) {
                         return better(is_max, e.value, back.value);
                       });
  }
}

void clear_state(const WindowSpec& w, WindowState& s, int64_t pos) {
  size_aggregates(w, s.agg);
  s.extremes.resize(w.extremes.size());
  for (MonoQueue& q : s.extremes) q.clear();
  s.first_ts.clear();
  s.last_ts.clear();
  s.from = s.to = pos;
}

// Brings a sliding window's aggregates to the stable rows at the current watermark.
void sync_sliding(const WindowContext& ctx, const WindowSpec& w, WindowState& s,
                  const EventLog& log) {
  const int64_t lo = ctx.watermark - w.size + 1, stable = ctx.watermark - ctx.lateness;
  bool removed = false;
  for (; s.from < s.to && log.ts(s.from) < lo; ++s.from) {
    apply_row(w, ctx.edges, log.row(s.from), -1, s.agg);
    removed = true;
  }
  for (; s.to < log.end() && log.ts(s.to) < stable; ++s.to) {
    if (log.ts(s.to) < lo) {
      s.from = s.to + 1;  // sorted: only before any row enters
    } else {
      enter(ctx, w, s, log, s.to);
    }
  }
  s.lo_ts = lo;
  for (MonoQueue& q : s.extremes) {
    while (q.size() && q.front().ts < lo) q.pop_front();
  }
  if (removed) reseed(w, s.agg, Rows{&log, s.from, s.to, kMin, kMax});
}

// Adds a row outside the running aggregates to a firing's copy of them.
void add_fringe(const WindowContext& ctx, const WindowSpec& w, const int64_t* row,
                WindowScratch& scratch) {
  add_row(w, ctx.edges, row, scratch.agg);
  for (size_t k = 0; k < w.extremes.size(); ++k) {
    const auto [column, is_max] = w.extremes[k];
    const double v = EventLog::value(row, static_cast<size_t>(column));
    double& best = scratch.extremes[k];
    if (std::isnan(best) || better(is_max, v, best)) best = v;
  }
}

void query_sliding(const WindowContext& ctx, const WindowSpec& w, WindowState& s, WindowRead& r,
                   const EventLog& log, int64_t t, WindowScratch& scratch) {
  if (log.size() <= kScanRows) return scan_sliding(ctx, w, r, log, t, scratch);
  sync_sliding(ctx, w, s, log);
  const int64_t lo = t - w.size + 1;
  scratch.agg = s.agg;
  refill(scratch.extremes, w.extremes.size(), kNaN);
  for (size_t k = 0; k < w.extremes.size(); ++k) {
    if (s.extremes[k].size()) scratch.extremes[k] = s.extremes[k].front().value;
  }
  // The stable rows cover [watermark - size + 1, watermark - lateness): add the rows
  // of [lo, t] on either side of them (those of a late firing's earlier start, and the
  // ones a late row may still join).
  int64_t first = s.from;
  for (; first > log.begin() && log.ts(first - 1) >= lo; --first) {
    if (log.ts(first - 1) <= t) add_fringe(ctx, w, log.row(first - 1), scratch);
  }
  for (int64_t p = s.to; p < log.end(); ++p) {
    const int64_t ts = log.ts(p);
    if (ts >= lo && ts <= t) add_fringe(ctx, w, log.row(p), scratch);
  }
  int64_t last = kNone;
  for (int64_t p = log.end() - 1; p >= log.begin(); --p) {
    const int64_t ts = log.ts(p);
    if (ts > t) continue;
    if (ts >= lo) last = p;
    break;
  }
  const Rows rows{&log, first, log.end(), lo, t};
  finish(w, scratch.agg, rows, scratch.extremes.data(), last, scratch.values, r.out.data());
  r.lo = lo;
  r.hi = t + 1;
}

void compute_bucket(const WindowContext& ctx, const WindowSpec& w, WindowState& s,
                    const EventLog& log, uint64_t appends, int64_t end, WindowScratch& scratch);

void query_tumbling(const WindowContext& ctx, const WindowSpec& w, WindowState& s, WindowRead& r,
                    const EventLog& log, uint64_t appends, int64_t t, WindowScratch& scratch) {
  const int64_t end = t / w.size * w.size;  // ts >= 0, so this is floor division
  r.lo = end - w.size;
  r.hi = end;
  // Rows appended since the bucket was computed are no more than lateness behind that
  // watermark: if the bucket ends before, none of them is in it.
  if (s.bucket != end || (s.bucket_appends != appends && end > s.bucket_wm - ctx.lateness)) {
    compute_bucket(ctx, w, s, log, appends, end, scratch);
  }
  r.out.assign(s.bucket_out.begin(), s.bucket_out.end());
}

// Computes the bucket ending at `end` into the state's cache.
void compute_bucket(const WindowContext& ctx, const WindowSpec& w, WindowState& s,
                    const EventLog& log, uint64_t appends, int64_t end, WindowScratch& scratch) {
  const Rows rows{&log, log.lower_bound(log.begin(), end - w.size),
                  log.lower_bound(log.begin(), end), end - w.size, end - 1};
  size_aggregates(w, scratch.agg);
  refill(scratch.extremes, w.extremes.size(), kNaN);
  rows.each([&](const int64_t* row) { add_fringe(ctx, w, row, scratch); });
  // Sorted by ts, ties in arrival order: the bucket's last row is its `last`.
  const int64_t last = rows.to > rows.from ? rows.to - 1 : kNone;
  s.bucket_out.resize(static_cast<size_t>(w.n_out));
  finish(w, scratch.agg, rows, scratch.extremes.data(), last, scratch.values, s.bucket_out.data());
  s.bucket = end;
  s.bucket_wm = ctx.watermark;
  s.bucket_appends = appends;
}

// Brings a count window to the log's last `size` rows: row by row if the rows leaving
// are still in the log, else rebuilt (then there were more arrivals than it has rows).
void sync_count(const WindowContext& ctx, const WindowSpec& w, WindowState& s,
                const EventLog& log) {
  const int64_t start = std::max(log.begin(), log.end() - w.size);
  if (s.from < log.begin() || s.to < start) clear_state(w, s, start);
  for (; s.to < log.end(); ++s.to) {
    enter(ctx, w, s, log, s.to);
    const int64_t ts = log.ts(s.to);
    s.first_ts.push({s.to, ts, 0}, [](const auto& e, const auto& back) { return e.ts <= back.ts; });
    // `last`: the greatest ts, ties to the latest arrival.
    s.last_ts.push({s.to, ts, 0}, [](const auto& e, const auto& back) { return e.ts >= back.ts; });
  }
  const bool removed = s.from < start;
  for (; s.from < start; ++s.from) apply_row(w, ctx.edges, log.row(s.from), -1, s.agg);
  for (MonoQueue* q : {&s.first_ts, &s.last_ts}) {
    while (q->size() && q->front().pos < start) q->pop_front();
  }
  for (MonoQueue& q : s.extremes) {
    while (q.size() && q.front().pos < start) q.pop_front();
  }
  if (removed) reseed(w, s.agg, Rows{&log, s.from, s.to, kMin, kMax});
}

void query_count(const WindowContext& ctx, const WindowSpec& w, WindowState& s, WindowRead& r,
                 const EventLog& log, WindowScratch& scratch) {
  sync_count(ctx, w, s, log);
  refill(scratch.extremes, w.extremes.size(), kNaN);
  for (size_t k = 0; k < w.extremes.size(); ++k) {
    if (s.extremes[k].size()) scratch.extremes[k] = s.extremes[k].front().value;
  }
  const bool any = s.agg.n > 0;
  const Rows rows{&log, s.from, s.to, kMin, kMax};
  finish(w, s.agg, rows, scratch.extremes.data(), any ? s.last_ts.front().pos : kNone,
         scratch.values, r.out.data());
  r.lo = any ? s.first_ts.front().ts : kMax;
  r.hi = any ? s.last_ts.front().ts + 1 : kMin;
}

// Drops the rows no window can see any more. A sliding window's state that still held
// some (not read for a while) starts afresh: its next read re-adds the log's rows, at
// most once per doubling of the log.
void trim_sorted(const WindowContext& ctx, int32_t l, KeyLogs& logs,
                 std::vector<WindowState>& states) {
  const LogSpec& spec = ctx.group.logs[static_cast<size_t>(l)];
  EventLog& log = logs[static_cast<size_t>(l)].sorted;
  const int64_t horizon = ctx.watermark - ctx.lateness - spec.reach;
  while (!log.empty() && log.ts(log.begin()) < horizon) log.pop_front();
  for (const int32_t w : spec.windows) {
    const WindowSpec& window = ctx.group.windows[static_cast<size_t>(w)];
    WindowState& s = states[w];
    if (window.kind == WindowKind::Sliding && s.from < log.begin()) {
      clear_state(window, s, log.begin());
      s.lo_ts = kMin;
    }
  }
  logs[static_cast<size_t>(l)].trim_at = 2 * log.size() + 16;
}

}  // namespace

const MonoQueue::Entry* MonoQueue::first_from(int64_t ts) const {
  const auto it = std::lower_bound(buf_.begin() + static_cast<std::ptrdiff_t>(head_), buf_.end(), ts,
                                   [](const Entry& e, int64_t t) { return e.ts < t; });
  return it == buf_.end() ? nullptr : &*it;
}

void size_reads(const Compiled& compiled, WindowScratch& scratch) {
  scratch.reads.resize(static_cast<size_t>(compiled.n_windows));
  for (const Group& g : compiled.groups) {
    for (size_t w = 0; w < g.windows.size(); ++w) {
      scratch.reads[static_cast<size_t>(g.window_base) + w].out.resize(
          static_cast<size_t>(g.windows[w].n_out));
    }
  }
}

void reset_windows(const Group& group, const KeyLogs& logs, std::vector<WindowState>& states) {
  states.resize(group.windows.size());
  for (size_t w = 0; w < group.windows.size(); ++w) {
    const WindowSpec& window = group.windows[w];
    WindowState& s = states[w];
    const auto l = static_cast<size_t>(window.log);
    clear_state(window, s, window.kind == WindowKind::Count ? logs[l].arrival.begin()
                                                            : logs[l].sorted.begin());
    s.lo_ts = kMin;
    s.bucket = kNone;
  }
}

namespace {

// Moves a key's time-window rows into a new sorted ring (they outgrew a scan), and
// starts its time windows' running state afresh from there.
void build_sorted(const WindowContext& ctx, int32_t l, KeyLogs& logs,
                  std::vector<WindowState>& states) {
  const LogSpec& spec = ctx.group.logs[static_cast<size_t>(l)];
  KeyLog& log = logs[static_cast<size_t>(l)];
  const int64_t horizon = ctx.watermark - ctx.lateness - spec.reach;
  for (int64_t p = log.arrival.begin(); p < log.arrival.end(); ++p) {
    if (log.arrival.ts(p) < horizon) continue;
    log.sorted.insert_row(log.arrival.row(p));  // in arrival order: ties stay in it
    ++log.appends;
  }
  for (const int32_t w : spec.windows) {
    const WindowSpec& window = ctx.group.windows[static_cast<size_t>(w)];
    if (window.kind == WindowKind::Count) continue;
    WindowState& s = states[static_cast<size_t>(w)];
    clear_state(window, s, log.sorted.begin());
    s.lo_ts = kMin;
    s.bucket = kNone;
  }
  log.trim_at = 2 * log.sorted.size() + 16;
}

}  // namespace

void start_sorted(const WindowContext& ctx, int32_t l, KeyLogs& logs,
                  std::vector<WindowState>& states) {
  build_sorted(ctx, l, logs, states);
  EventLog& arrival = logs[static_cast<size_t>(l)].arrival;
  const auto keep = static_cast<size_t>(ctx.group.logs[static_cast<size_t>(l)].keep);
  while (arrival.size() > keep) arrival.pop_front();
}

void append_ordered(const WindowContext& ctx, int32_t l, int64_t ts, const double* values,
                    KeyLogs& logs, std::vector<WindowState>& states) {
  const LogSpec& spec = ctx.group.logs[static_cast<size_t>(l)];
  KeyLog& log = logs[static_cast<size_t>(l)];
  EventLog& arrival = log.arrival;
  if (spec.keep > 0) {
    arrival.push(ts, values, spec.columns.data());
    // Short count windows are scanned, so they need only their rows. Longer ones are
    // trimmed in steps, so a count window read again soon catches up row by row.
    if (spec.keep <= kScanRows) {
      while (arrival.size() > static_cast<size_t>(spec.keep)) arrival.pop_front();
    } else if (arrival.size() > 2 * static_cast<size_t>(spec.keep) + 16) {
      while (arrival.size() > static_cast<size_t>(spec.keep)) arrival.pop_front();
    }
  }
  if (spec.reach < 0) return;
  log.sorted.insert_sorted(ts, values, spec.columns.data());
  ++log.appends;
  if (log.sorted.size() >= log.trim_at) trim_sorted(ctx, l, logs, states);
}

const WindowRead& query_window(const WindowContext& ctx, int32_t w, int64_t ts, uint64_t stamp,
                               const KeyLogs& logs, std::vector<WindowState>& states,
                               WindowScratch& scratch) {
  // Sized by size_reads when the triggers were compiled.
  WindowRead& r = scratch.reads[static_cast<size_t>(ctx.group.window_base + w)];
  if (r.stamp == stamp) return r;
  r.stamp = stamp;
  const WindowSpec& window = ctx.group.windows[static_cast<size_t>(w)];
  const auto l = static_cast<size_t>(window.log);
  if (window.kind != WindowKind::Count && logs[l].sorted.empty()) {
    int64_t lo = ts - window.size + 1, hi = ts;
    if (window.kind == WindowKind::Tumbling) {
      hi = ts / window.size * window.size - 1;  // ts >= 0, so this is floor division
      lo = hi + 1 - window.size;
    }
    scan_arrival(ctx, window, r, logs[l].arrival, lo, hi, scratch);
    r.lo = lo;
    r.hi = hi + 1;
    return r;
  }
  WindowState& s = states[static_cast<size_t>(w)];
  switch (window.kind) {
    case WindowKind::Sliding: query_sliding(ctx, window, s, r, logs[l].sorted, ts, scratch); break;
    case WindowKind::Tumbling:
      query_tumbling(ctx, window, s, r, logs[l].sorted, logs[l].appends, ts, scratch);
      break;
    case WindowKind::Count:
      if (window.size <= kScanRows) {  // scanned: the per-key state is not touched
        scan_count(ctx, window, r, logs[l].arrival, scratch);
      } else {
        query_count(ctx, window, s, r, logs[l].arrival, scratch);
      }
      break;
  }
  return r;
}

}  // namespace skiff::stream
