#include "window_scan.hpp"

#include <algorithm>
#include <cmath>

#include "window_stats.hpp"

namespace skiff::stream {
namespace {

// `best` (NaN: none yet) and the rows' values in `column`, by `better`.
double extreme(const int64_t* const* rows, size_t n, size_t column, bool is_max, double best) {
  size_t j = 0;
  if (std::isnan(best) && n > 0) best = EventLog::value(rows[j++], column);
  // Values are finite, so from here on `better` alone decides (as in add_fringe); ties
  // go to the later row (-0.0 after 0.0), as there.
  if (is_max) {
    for (; j < n; ++j) {
      const double v = EventLog::value(rows[j], column);
      best = v >= best ? v : best;
    }
  } else {
    for (; j < n; ++j) {
      const double v = EventLog::value(rows[j], column);
      best = v <= best ? v : best;
    }
  }
  return best;
}

// The scan's picked rows, reused: room for `n` more, returned as where to write.
const int64_t** pick_room(WindowScratch& scratch, size_t n) {
  if (scratch.picked.size() < n) scratch.picked.resize(n);
  return scratch.picked.data();
}

// add_fringe over `n` rows, column by column: each loop is a few instructions a row with
// nothing reloaded, where add_fringe walks every list of the window's spec per row.
// The rows are added in the order given, as add_fringe would: the same sums, bit for bit.
void add_rows(const WindowContext& ctx, const WindowSpec& w, const int64_t* const* rows,
              size_t n, WindowScratch& scratch) {
  Aggregates& a = scratch.agg;
  a.n += static_cast<int64_t>(n);
  for (size_t i = 0; i < w.sum_columns.size(); ++i) {
    const auto column = static_cast<size_t>(w.sum_columns[i]);
    RunningSum sum = a.sums[i];
    for (size_t k = 0; k < n; ++k) sum.add(EventLog::value(rows[k], column));
    a.sums[i] = sum;
  }
  for (size_t i = 0; i < w.sq_columns.size(); ++i) {
    const auto column = static_cast<size_t>(w.sq_columns[i]);
    RunningSum sum = a.sqs[i];
    for (size_t k = 0; k < n; ++k) {
      const double x = EventLog::value(rows[k], column);
      double p, e;
      two_prod(x, x, p, e);
      sum.add(p);
      sum.add(e);
    }
    a.sqs[i] = sum;
  }
  for (size_t k = 0; k < w.extremes.size(); ++k) {
    const auto [column, is_max] = w.extremes[k];
    scratch.extremes[k] =
        extreme(rows, n, static_cast<size_t>(column), is_max, scratch.extremes[k]);
  }
  if (w.n_bins == 0) return;
  for (const Stat& st : w.stats) {
    if (st.bins < 0) continue;
    for (size_t j = 0; j < n; ++j) {
      const int64_t bin = bin_of(ctx.edges.data() + st.edges_begin, st.edges_end - st.edges_begin,
                                 EventLog::value(rows[j], static_cast<size_t>(st.column)));
      if (bin >= 0) ++a.bins[static_cast<size_t>(st.bins + bin)];
    }
  }
}

// The window's outputs from the `n` rows a scan picked (in scan order) out of `window`.
// Without a std or histogram, each stat is read straight off the rows: a scan of a few
// rows is most firings' whole cost, and building Aggregates for `finish` first was most
// of the scan's. Sums add the rows in the order add_rows does, from zero, so both ways
// give the same bits; std and histograms (sums of squares, bins) take add_rows + finish.
void finish_scan(const WindowContext& ctx, const WindowSpec& w, const int64_t* const* rows,
                 size_t n, const Rows& window, int64_t last, WindowScratch& scratch,
                 double* out) {
  if (!w.sq_columns.empty() || w.n_bins > 0) {
    size_aggregates(w, scratch.agg);
    refill(scratch.extremes, w.extremes.size(), kNaN);
    add_rows(ctx, w, rows, n, scratch);
    finish(w, scratch.agg, window, scratch.extremes.data(), last, scratch.values, out);
    return;
  }
  const auto count = static_cast<double>(n);
  for (const Stat& s : w.stats) {
    double* o = out + s.out;
    const auto column = static_cast<size_t>(s.column);
    switch (s.agg) {
      case Agg::Count: *o = count; break;
      case Agg::Sum:
      case Agg::Mean: {
        RunningSum sum;
        for (size_t k = 0; k < n; ++k) sum.add(EventLog::value(rows[k], column));
        const double total = sum.trusted() ? sum.value() : exact_sum(window, s.column);
        *o = s.agg == Agg::Sum ? total : n ? total / count : kNaN;
        break;
      }
      case Agg::Min:
      case Agg::Max: *o = n ? extreme(rows, n, column, s.agg == Agg::Max, kNaN) : kNaN; break;
      case Agg::Last: *o = last == kNone ? kNaN : window.log->value(last, column); break;
      case Agg::Distinct: *o = distinct(window, s.column, scratch.values); break;
      case Agg::Std:
      case Agg::Histogram: break;  // taken above
    }
  }
}

}  // namespace

// Scans the key's rows with ts in [lo, t] (a log of a few rows: cheaper than syncing).
void scan_sliding(const WindowContext& ctx, const WindowSpec& w, WindowRead& r,
                  const EventLog& log, int64_t t, WindowScratch& scratch) {
  const int64_t lo = t - w.size + 1;
  // Newest first, stopping at the first row before the window (the log is sorted by
  // ts): the older rows the log still keeps are not touched.
  int64_t last = kNone, first = log.end();
  const int64_t** picked = pick_room(scratch, log.size());
  size_t n = 0;
  for (int64_t p = log.end() - 1; p >= log.begin(); --p) {
    const int64_t* row = log.row(p);
    if (row[0] > t) continue;
    if (row[0] < lo) break;
    picked[n++] = row;
    if (last == kNone) last = p;  // ties in arrival order: the newest is the latest
    first = p;
  }
  const Rows rows{&log, first, last == kNone ? first : last + 1, lo, t};
  finish_scan(ctx, w, picked, n, rows, last, scratch, r.out.data());
  r.lo = lo;
  r.hi = t + 1;
}

// What a scan loop found: its rows' count, the window's `last` row (kNone: none) and
// its rows for finish's fallbacks (exact sums, distinct counts).
struct Found {
  size_t n;
  int64_t last;
  Rows rows;
};

// Window `w` from the rows a scan loop meets: `loop(take)` calls take(row) for each
// of the window's rows, in the order finish_scan takes them, and returns what it found.
// A window with one stat other than std, histogram and distinct (most) is computed as
// the rows come, exactly as finish_scan computes it from them (the same additions in
// the same order: the same bits); the others pick the rows (at most `most`) first.
template <class Loop>
void read_rows(const WindowContext& ctx, const WindowSpec& w, size_t most, Loop&& loop,
               WindowScratch& scratch, double* out) {
  const bool one = w.stats.size() == 1 && w.sq_columns.empty() && w.n_bins == 0;
  const Agg agg = one ? w.stats[0].agg : Agg::Distinct;
  const auto column = static_cast<size_t>(one ? w.stats[0].column : 0);
  double* o = out + (one ? w.stats[0].out : 0);
  switch (agg) {
    case Agg::Count:
    case Agg::Last: {
      const Found f = loop([](const int64_t*) {});
      if (agg == Agg::Count) {
        *o = static_cast<double>(f.n);
      } else {
        *o = f.last == kNone ? kNaN : f.rows.log->value(f.last, column);
      }
      return;
    }
    case Agg::Sum:
    case Agg::Mean: {
      RunningSum sum;
      const Found f = loop([&](const int64_t* row) { sum.add(EventLog::value(row, column)); });
      const double total = sum.trusted() ? sum.value() : exact_sum(f.rows, w.stats[0].column);
      *o = agg == Agg::Sum ? total : f.n ? total / static_cast<double>(f.n) : kNaN;
      return;
    }
    case Agg::Max:
    case Agg::Min: {
      // As extreme(): the first row, then `>=` (`<=`), ties to the later row; values
      // are finite, so !(v < best) is v >= best, and true while best is NaN (no row).
      double best = kNaN;
      const Found f = agg == Agg::Max ? loop([&](const int64_t* row) {
        const double v = EventLog::value(row, column);
        best = !(v < best) ? v : best;
      })
                                      : loop([&](const int64_t* row) {
                                          const double v = EventLog::value(row, column);
                                          best = !(v > best) ? v : best;
                                        });
      *o = f.n ? best : kNaN;
      return;
    }
    default: {
      const int64_t** picked = pick_room(scratch, most);
      size_t k = 0;
      const Found f = loop([&](const int64_t* row) { picked[k++] = row; });
      finish_scan(ctx, w, picked, f.n, f.rows, f.last, scratch, out);
    }
  }
}

// A time window [lo, hi] read from the arrival ring (no sorted ring: a few rows), newest
// first. Every row arrives at most `lateness` behind the watermark, which is at least
// the ts of every earlier arrival: past a row older than lo - lateness, all are older
// than lo.
void scan_arrival(const WindowContext& ctx, const WindowSpec& w, WindowRead& r,
                  const EventLog& log, int64_t lo, int64_t hi, WindowScratch& scratch) {
  const int64_t stop = lo < kMin + ctx.lateness ? kMin : lo - ctx.lateness;
  const auto loop = [&](auto&& take) {
    int64_t last = kNone, last_ts = kMin, first = log.end();
    size_t n = 0;
    for (int64_t p = log.end() - 1; p >= log.begin(); --p) {
      const int64_t* row = log.row(p);
      if (row[0] < stop) break;
      first = p;
      if (row[0] < lo || row[0] > hi) continue;
      take(row);
      ++n;
      // `last`: the greatest ts (ts >= 0 > kMin: the first row is taken); newest
      // first, so ties go to the latest arrival.
      if (row[0] > last_ts) {
        last = p;
        last_ts = row[0];
      }
    }
    return Found{n, last, Rows{&log, first, log.end(), lo, hi}};
  };
  read_rows(ctx, w, log.size(), loop, scratch, r.out.data());
}

void scan_count(const WindowContext& ctx, const WindowSpec& w, WindowRead& r,
                const EventLog& log, WindowScratch& scratch) {
  const Rows rows{&log, std::max(log.begin(), log.end() - w.size), log.end(), kMin, kMax};
  // Hull and `last` in locals: stored through `r` in the loop, they were written back
  // at every row (the compiler cannot tell `r` from the rows).
  int64_t lo = kMax, hi = kMin;
  const auto loop = [&](auto&& take) {
    int64_t last = kNone, last_ts = kMin;
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
    return Found{static_cast<size_t>(rows.to - rows.from), last, rows};
  };
  read_rows(ctx, w, static_cast<size_t>(rows.to - rows.from), loop, scratch, r.out.data());
  r.lo = lo;
  r.hi = hi;
}

}  // namespace skiff::stream
