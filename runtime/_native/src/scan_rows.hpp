// A window's rows read straight off a key's arrival ring, and a one-value stat computed as
// the rows are met. Shared by window_scan.cpp (a window at a time, into its read) and
// fused_scan.cpp (a trigger's windows straight into its feature row): one copy of the
// loops and the arithmetic, so both ways give the same bits.
#pragma once

#include <algorithm>
#include <cstdint>

#include "window_stats.hpp"

namespace skiff::stream {

// What a scan loop found: its rows' count, the window's `last` row (kNone: none) and
// its rows for the fallbacks that read them again (exact sums, distinct counts).
struct Found {
  size_t n;
  int64_t last;
  Rows rows;
};

// A time window [lo, hi] read from the arrival ring (no sorted ring: a few rows), newest
// first: take(row) for each of its rows. Every row arrives at most `lateness` behind the
// watermark, which is at least the ts of every earlier arrival: past a row older than
// lo - lateness, all are older than lo.
template <class Take>
Found arrival_rows(const EventLog& log, int64_t lo, int64_t hi, int64_t lateness, Take&& take) {
  const int64_t stop = lo < kMin + lateness ? kMin : lo - lateness;
  int64_t last = kNone, last_ts = kMin, first = log.end();
  size_t n = 0;
  for (int64_t p = log.end() - 1; p >= log.begin(); --p) {
    const int64_t* row = log.row(p);
    if (row[0] < stop) break;
    first = p;
    if (row[0] < lo || row[0] > hi) continue;
    take(row);
    ++n;
    // `last`: the greatest ts (ts >= 0 > kMin: the first row is taken); newest first,
    // so ties go to the latest arrival.
    if (row[0] > last_ts) {
      last = p;
      last_ts = row[0];
    }
  }
  return Found{n, last, Rows{&log, first, log.end(), lo, hi}};
}

// A count window: the arrival ring's last `size` rows, oldest first: take(row) for each.
// Their ts hull goes to [ts_lo, ts_hi) (kMax, kMin: none), written once at the end: kept
// in locals, not stored through the references at every row (the compiler cannot tell
// them from the rows).
template <class Take>
Found count_rows(const EventLog& log, int64_t size, int64_t& ts_lo, int64_t& ts_hi,
                 Take&& take) {
  const Rows rows{&log, std::max(log.begin(), log.end() - size), log.end(), kMin, kMax};
  int64_t lo = kMax, hi = kMin, last = kNone, last_ts = kMin;
  for (int64_t p = rows.from; p < rows.to; ++p) {
    const int64_t* row = log.row(p);
    take(row);
    const int64_t ts = row[0];
    if (ts >= last_ts) {  // ts >= 0 > kMin: the first row is taken; ties to the latest
      last = p;
      last_ts = ts;
    }
    lo = std::min(lo, ts);
    hi = std::max(hi, ts + 1);
  }
  ts_lo = lo;
  ts_hi = hi;
  return Found{static_cast<size_t>(rows.to - rows.from), last, rows};
}

// Stat `agg` (one_pass) of `column` over the rows `loop(take)` meets, as they come: the
// same additions in the same order as finish_scan makes from the picked rows.
template <class Loop>
double one_stat(Agg agg, int32_t column, Loop&& loop) {
  const auto c = static_cast<size_t>(column);
  switch (agg) {
    case Agg::Count: return static_cast<double>(loop([](const int64_t*) {}).n);
    case Agg::Last: {
      const Found f = loop([](const int64_t*) {});
      return f.last == kNone ? kNaN : f.rows.log->value(f.last, c);
    }
    case Agg::Sum:
    case Agg::Mean: {
      RunningSum sum;
      const Found f = loop([&](const int64_t* row) { sum.add(EventLog::value(row, c)); });
      const double total = sum.trusted() ? sum.value() : exact_sum(f.rows, column);
      return agg == Agg::Sum ? total : f.n ? total / static_cast<double>(f.n) : kNaN;
    }
    case Agg::Max:
    case Agg::Min: {
      // As extreme(): the first row, then `>=` (`<=`), ties to the later row; values
      // are finite, so !(v < best) is v >= best, and true while best is NaN (no row).
      double best = kNaN;
      const Found f = agg == Agg::Max ? loop([&](const int64_t* row) {
        const double v = EventLog::value(row, c);
        best = !(v < best) ? v : best;
      })
                                      : loop([&](const int64_t* row) {
                                          const double v = EventLog::value(row, c);
                                          best = !(v > best) ? v : best;
                                        });
      return f.n ? best : kNaN;
    }
    default: return kNaN;  // not one_pass
  }
}

}  // namespace skiff::stream
