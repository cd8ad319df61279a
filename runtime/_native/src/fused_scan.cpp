// A trigger's scanned windows read straight into its feature row: each part takes its
// rows in the order its own scan (window_scan.cpp) takes them, with the same arithmetic,
// so every output has the same bits; without the per-window dispatch, output buffers
// and stamps of query_window.
#include "fused_scan.hpp"

#include <algorithm>

#include "window_stats.hpp"

namespace skiff::stream {
namespace {

// What a part's loop found: its rows, the window's `last` row (kNone: none), and the
// first position visited (a time window's exact sum reads the rows from there).
struct Seen {
  size_t n;
  int64_t last, first;
};

// One stat from the rows `loop(take)` feeds to `take`, as read_rows (window_scan.cpp)
// computes it from the same rows in the same order.
template <class Loop>
double stat_of(Agg agg, int32_t column, const EventLog& log, int64_t lo, int64_t hi,
               Loop&& loop) {
  const auto c = static_cast<size_t>(column);
  switch (agg) {
    case Agg::Count: return static_cast<double>(loop([](const int64_t*) {}).n);
    case Agg::Last: {
      const Seen f = loop([](const int64_t*) {});
      return f.last == kNone ? kNaN : log.value(f.last, c);
    }
    case Agg::Sum:
    case Agg::Mean: {
      RunningSum sum;
      const Seen f = loop([&](const int64_t* row) { sum.add(EventLog::value(row, c)); });
      const double total =
          sum.trusted() ? sum.value() : exact_sum(Rows{&log, f.first, log.end(), lo, hi}, column);
      return agg == Agg::Sum ? total : f.n ? total / static_cast<double>(f.n) : kNaN;
    }
    case Agg::Max: {
      double best = kNaN;
      const Seen f = loop([&](const int64_t* row) {
        const double v = EventLog::value(row, c);
        best = !(v < best) ? v : best;
      });
      return f.n ? best : kNaN;
    }
    case Agg::Min: {
      double best = kNaN;
      const Seen f = loop([&](const int64_t* row) {
        const double v = EventLog::value(row, c);
        best = !(v > best) ? v : best;
      });
      return f.n ? best : kNaN;
    }
    default: return kNaN;  // not in a ScanPlan
  }
}

}  // namespace

bool scan_features(const CompiledTrigger& trigger, const KeyLogs& logs, int64_t lateness,
                   int64_t ts, double* out, int64_t& lo, int64_t& hi) {
  const ScanPlan& plan = trigger.scan;
  const KeyLog& key_log = logs[static_cast<size_t>(plan.log)];
  if (plan.time && !key_log.sorted.empty()) return false;
  const EventLog& log = key_log.arrival;
  lo = kMax;
  hi = kMin;
  for (const ScanPart& sp : plan.parts) {
    int64_t w_lo, w_hi;
    if (sp.kind == WindowKind::Count) {  // as scan_count: oldest first
      const int64_t from = std::max(log.begin(), log.end() - sp.size);
      w_lo = kMax;
      w_hi = kMin;
      const auto loop = [&](auto&& take) {
        int64_t last = kNone, last_ts = kMin;
        for (int64_t p = from; p < log.end(); ++p) {
          const int64_t* row = log.row(p);
          take(row);
          const int64_t t = row[0];
          if (t >= last_ts) {
            last = p;
            last_ts = t;
          }
          w_lo = std::min(w_lo, t);
          w_hi = std::max(w_hi, t + 1);
        }
        return Seen{static_cast<size_t>(log.end() - from), last, from};
      };
      out[sp.offset] = stat_of(sp.agg, sp.column, log, kMin, kMax, loop);
    } else {  // as scan_arrival: newest first, down to the first row older than `stop`
      int64_t wl = ts - sp.size + 1, wh = ts;
      if (sp.kind == WindowKind::Tumbling) {
        wh = ts / sp.size * sp.size - 1;  // ts >= 0, so this is floor division
        wl = wh + 1 - sp.size;
      }
      const int64_t stop = wl < kMin + lateness ? kMin : wl - lateness;
      const auto loop = [&](auto&& take) {
        int64_t last = kNone, last_ts = kMin, first = log.end();
        size_t n = 0;
        for (int64_t p = log.end() - 1; p >= log.begin(); --p) {
          const int64_t* row = log.row(p);
          if (row[0] < stop) break;
          first = p;
          if (row[0] < wl || row[0] > wh) continue;
          take(row);
          ++n;
          if (row[0] > last_ts) {
            last = p;
            last_ts = row[0];
          }
        }
        return Seen{n, last, first};
      };
      out[sp.offset] = stat_of(sp.agg, sp.column, log, wl, wh, loop);
      w_lo = wl;
      w_hi = wh + 1;
    }
    if (w_lo <= w_hi) {
      lo = std::min(lo, w_lo);
      hi = std::max(hi, w_hi);
    }
  }
  if (lo > hi) {  // no window contributed bounds: the firing event alone
    lo = ts;
    hi = ts + 1;
  }
  return true;
}

}  // namespace skiff::stream
