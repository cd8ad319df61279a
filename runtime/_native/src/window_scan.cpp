#include "window_scan.hpp"

#include <algorithm>
#include <cmath>

#include "scan_rows.hpp"
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

// Window `w` from the rows a scan loop meets: `loop(take)` calls take(row) for each
// of the window's rows, in the order finish_scan takes them, and returns what it found.
// A window with one stat other than std, histogram and distinct (most) is computed as
// the rows come (one_stat: the same bits as finish_scan); the others pick the rows (at
// most `most`) first.
template <class Loop>
void read_rows(const WindowContext& ctx, const WindowSpec& w, size_t most, Loop&& loop,
               WindowScratch& scratch, double* out) {
  if (w.stats.size() == 1 && w.sq_columns.empty() && w.n_bins == 0 && one_pass(w.stats[0].agg)) {
    out[w.stats[0].out] = one_stat(w.stats[0].agg, w.stats[0].column, loop);
    return;
  }
  const int64_t** picked = pick_room(scratch, most);
  size_t k = 0;
  const Found f = loop([&](const int64_t* row) { picked[k++] = row; });
  finish_scan(ctx, w, picked, f.n, f.rows, f.last, scratch, out);
}

void scan_arrival(const WindowContext& ctx, const WindowSpec& w, WindowRead& r,
                  const EventLog& log, int64_t lo, int64_t hi, WindowScratch& scratch) {
  const auto loop = [&](auto&& take) { return arrival_rows(log, lo, hi, ctx.lateness, take); };
  read_rows(ctx, w, log.size(), loop, scratch, r.out.data());
}

void scan_count(const WindowContext& ctx, const WindowSpec& w, WindowRead& r,
                const EventLog& log, WindowScratch& scratch) {
  const auto most = static_cast<size_t>(std::min<int64_t>(w.size, log.size()));
  const auto loop = [&](auto&& take) { return count_rows(log, w.size, r.lo, r.hi, take); };
  read_rows(ctx, w, most, loop, scratch, r.out.data());
}

}  // namespace skiff::stream
