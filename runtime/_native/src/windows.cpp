#include "windows.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace skiff::stream {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// a * b == p + e exactly (barring underflow).
inline void two_prod(double a, double b, double& p, double& e) {
  p = a * b;
  e = std::fma(a, b, -p);
}

// Rows at positions [from, to) of a log whose ts is in [ts_lo, ts_hi]: the window, for
// what is computed from scratch (exact sums, distinct counts, tumbling buckets).
struct Rows {
  const EventLog* log;
  int64_t from, to, ts_lo, ts_hi;

  template <class Visit>
  void each(Visit&& visit) const {
    for (int64_t p = from; p < to; ++p) {
      const int64_t* row = log->row(p);
      if (row[0] >= ts_lo && row[0] <= ts_hi) visit(row);
    }
  }
};

// Sets the first n entries of `v` to x, growing it if it is shorter. Only the first n
// are read (entries are addressed through a WindowSpec's indices): a firing's scratch
// serves windows of several shapes in turn, and resizing it to each was an out-of-line
// call per window read.
template <class T>
void refill(std::vector<T>& v, size_t n, const T& x) {
  if (v.size() < n) v.resize(n);
  std::fill(v.data(), v.data() + n, x);
}

void size_aggregates(const WindowSpec& w, Aggregates& a) {
  a.n = 0;
  refill(a.sums, w.sum_columns.size(), RunningSum{});
  refill(a.sqs, w.sq_columns.size(), RunningSum{});
  refill(a.bins, static_cast<size_t>(w.n_bins), int64_t{0});
}

// numpy's bins: [e_i, e_i+1) except the last, which is closed; -1 outside.
int64_t bin_of(const double* e, int32_t n_edges, double v) {
  const int32_t bins = n_edges - 1;
  if (v < e[0] || v > e[bins]) return -1;
  if (v == e[bins]) return bins - 1;
  return std::upper_bound(e, e + n_edges, v) - e - 1;
}

// Adds (sign 1) or removes (sign -1) one row.
void apply_row(const WindowSpec& w, const std::vector<double>& edges, const int64_t* row,
               int sign, Aggregates& a) {
  a.n += sign;
  if (a.n == 0) {  // an empty window's sums are exactly zero: drop any residue
    for (RunningSum& s : a.sums) s.reset();
    for (RunningSum& s : a.sqs) s.reset();
  } else {
    for (size_t i = 0; i < w.sum_columns.size(); ++i) {
      const double x = EventLog::value(row, static_cast<size_t>(w.sum_columns[i]));
      a.sums[i].add(sign > 0 ? x : -x);
    }
    for (size_t i = 0; i < w.sq_columns.size(); ++i) {
      const double x = EventLog::value(row, static_cast<size_t>(w.sq_columns[i]));
      double p, e;
      two_prod(x, x, p, e);
      a.sqs[i].add(sign > 0 ? p : -p);
      a.sqs[i].add(sign > 0 ? e : -e);
    }
  }
  for (const Stat& s : w.stats) {
    if (s.bins < 0) continue;
    const int64_t bin = bin_of(edges.data() + s.edges_begin, s.edges_end - s.edges_begin,
                               EventLog::value(row, static_cast<size_t>(s.column)));
    if (bin >= 0) a.bins[static_cast<size_t>(s.bins + bin)] += sign;
  }
}

// apply_row(+1) without its empty-window branch: what a scanned window does per row.
void add_row(const WindowSpec& w, const std::vector<double>& edges, const int64_t* row,
             Aggregates& a) {
  ++a.n;
  for (size_t i = 0; i < w.sum_columns.size(); ++i) {
    a.sums[i].add(EventLog::value(row, static_cast<size_t>(w.sum_columns[i])));
  }
  for (size_t i = 0; i < w.sq_columns.size(); ++i) {
    const double x = EventLog::value(row, static_cast<size_t>(w.sq_columns[i]));
    double p, e;
    two_prod(x, x, p, e);
    a.sqs[i].add(p);
    a.sqs[i].add(e);
  }
  if (w.n_bins == 0) return;
  for (const Stat& s : w.stats) {
    if (s.bins < 0) continue;
    const int64_t bin = bin_of(edges.data() + s.edges_begin, s.edges_end - s.edges_begin,
                               EventLog::value(row, static_cast<size_t>(s.column)));
    if (bin >= 0) ++a.bins[static_cast<size_t>(s.bins + bin)];
  }
}

// Re-sums exactly, from the rows, any running sum that can no longer vouch for itself.
void reseed(const WindowSpec& w, Aggregates& a, const Rows& rows) {
  const auto exact = [&](RunningSum& sum, int32_t column, bool squares) {
    if (sum.trusted()) return;
    ExactSum es;
    rows.each([&](const int64_t* row) {
      const double x = EventLog::value(row, static_cast<size_t>(column));
      double p = x, e = 0;
      if (squares) two_prod(x, x, p, e);
      es.add(p);
      es.add(e);
    });
    double hi, lo;
    es.split(hi, lo);
    sum.set(hi, lo, std::fabs(lo) * 0x1p-52);
  };
  for (size_t i = 0; i < w.sum_columns.size(); ++i) exact(a.sums[i], w.sum_columns[i], false);
  for (size_t i = 0; i < w.sq_columns.size(); ++i) exact(a.sqs[i], w.sq_columns[i], true);
}

double exact_sum(const Rows& rows, int32_t column) {
  ExactSum es;
  rows.each([&](const int64_t* row) { es.add(EventLog::value(row, static_cast<size_t>(column))); });
  return es.value();
}

// Population std from n, the running sum S and sum of squares Q: n*Q - S^2 summed from
// exact products, accepted only if its error bound is within kRelTol.
bool running_std(const Aggregates& a, const Stat& s, double& out) {
  const RunningSum& S = a.sums[static_cast<size_t>(s.sum)];
  const RunningSum& Q = a.sqs[static_cast<size_t>(s.sq)];
  const double n = static_cast<double>(a.n);
  double p[10];
  two_prod(n, Q.hi(), p[0], p[1]);
  two_prod(n, Q.lo(), p[2], p[3]);
  two_prod(S.hi(), S.hi(), p[4], p[5]);
  two_prod(2 * S.hi(), S.lo(), p[6], p[7]);
  two_prod(S.lo(), S.lo(), p[8], p[9]);
  RunningSum d;
  for (int i = 0; i < 10; ++i) d.add(i < 4 ? p[i] : -p[i]);
  const double s_abs = std::fabs(S.hi()) + std::fabs(S.lo());
  const double bound = d.err() + n * Q.err() + (2 * s_abs + S.err()) * S.err();
  const double v = d.value();
  if (!std::isfinite(v) || !std::isfinite(bound) || v < 0 || bound > kRelTol * v) return false;
  out = std::sqrt(v / (n * n));
  return true;
}

// Two passes around the exact mean (as hi + lo): for what `running_std` declines.
double exact_std(const Rows& rows, int32_t column, int64_t count) {
  ExactSum es;
  rows.each([&](const int64_t* row) { es.add(EventLog::value(row, static_cast<size_t>(column))); });
  double hi, lo, m_hi, m_lo;
  es.split(hi, lo);
  const double n = static_cast<double>(count);
  const double q = hi / n;
  two_sum(q, (std::fma(-q, n, hi) + lo) / n, m_hi, m_lo);
  RunningSum dev;
  rows.each([&](const int64_t* row) {
    double a, b, p, e;
    two_sum(EventLog::value(row, static_cast<size_t>(column)), -m_hi, a, b);
    const double d = a + (b - m_lo);
    two_prod(d, d, p, e);
    dev.add(p);
    dev.add(e);
  });
  return std::sqrt(dev.value() / n);
}

double distinct(const Rows& rows, int32_t column, std::vector<double>& values) {
  values.clear();
  rows.each([&](const int64_t* row) {
    const double v = EventLog::value(row, static_cast<size_t>(column));
    values.push_back(v == 0.0 ? 0.0 : v);  // -0.0 and 0.0 are one value
  });
  std::sort(values.begin(), values.end());
  return static_cast<double>(std::unique(values.begin(), values.end()) - values.begin());
}

// Every stat of the window from its aggregates, extremes and `last` row (kNone: none).
void finish(const WindowSpec& w, const Aggregates& a, const Rows& rows, const double* extremes,
            int64_t last, std::vector<double>& values, double* out) {
  const auto n = static_cast<double>(a.n);
  for (const Stat& s : w.stats) {
    double* o = out + s.out;
    switch (s.agg) {
      case Agg::Count: *o = n; break;
      case Agg::Sum:
      case Agg::Mean: {
        const RunningSum& sum = a.sums[static_cast<size_t>(s.sum)];
        const double total = sum.trusted() ? sum.value() : exact_sum(rows, s.column);
        *o = s.agg == Agg::Sum ? total : a.n ? total / n : kNaN;
        break;
      }
      case Agg::Std:
        if (a.n == 0) {
          *o = kNaN;
        } else if (!running_std(a, s, *o)) {
          *o = exact_std(rows, s.column, a.n);
        }
        break;
      case Agg::Min:
      case Agg::Max: *o = a.n ? extremes[s.extreme] : kNaN; break;
      case Agg::Last:
        *o = last == kNone ? kNaN : rows.log->value(last, static_cast<size_t>(s.column));
        break;
      case Agg::Distinct: *o = distinct(rows, s.column, values); break;
      case Agg::Histogram:
        for (int32_t b = 0; b < s.edges_end - s.edges_begin - 1; ++b) {
          o[b] = static_cast<double>(a.bins[static_cast<size_t>(s.bins + b)]);
        }
        break;
    }
  }
}

bool better(bool is_max, double a, double b) { return is_max ? a >= b : a <= b; }

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

// A time window [lo, hi] read from the arrival ring (no sorted ring: a few rows), newest
// first. Every row arrives at most `lateness` behind the watermark, which is at least
// the ts of every earlier arrival: past a row older than lo - lateness, all are older
// than lo.
void scan_arrival(const WindowContext& ctx, const WindowSpec& w, WindowRead& r,
                  const EventLog& log, int64_t lo, int64_t hi, WindowScratch& scratch) {
  const int64_t stop = lo < kMin + ctx.lateness ? kMin : lo - ctx.lateness;
  int64_t last = kNone, last_ts = kMin, first = log.end();
  const int64_t** picked = pick_room(scratch, log.size());
  size_t n = 0;
  for (int64_t p = log.end() - 1; p >= log.begin(); --p) {
    const int64_t* row = log.row(p);
    if (row[0] < stop) break;
    first = p;
    if (row[0] < lo || row[0] > hi) continue;
    picked[n++] = row;
    // `last`: the greatest ts; newest first, so ties go to the latest arrival.
    if (last == kNone || row[0] > last_ts) {
      last = p;
      last_ts = row[0];
    }
  }
  const Rows rows{&log, first, log.end(), lo, hi};
  finish_scan(ctx, w, picked, n, rows, last, scratch, r.out.data());
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


void scan_count(const WindowContext& ctx, const WindowSpec& w, WindowRead& r,
                const EventLog& log, WindowScratch& scratch) {
  const Rows rows{&log, std::max(log.begin(), log.end() - w.size), log.end(), kMin, kMax};
  int64_t last = kNone;
  r.lo = kMax;
  r.hi = kMin;
  const int64_t** picked = pick_room(scratch, static_cast<size_t>(rows.to - rows.from));
  size_t n = 0;
  int64_t last_ts = kMin;
  for (int64_t p = rows.from; p < rows.to; ++p) {
    const int64_t* row = log.row(p);
    picked[n++] = row;
    const int64_t ts = row[0];
    if (last == kNone || ts >= last_ts) {  // ties to the latest arrival
      last = p;
      last_ts = ts;
    }
    r.lo = std::min(r.lo, ts);
    r.hi = std::max(r.hi, ts + 1);
  }
  finish_scan(ctx, w, picked, n, rows, last, scratch, r.out.data());
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

void append_row(const WindowContext& ctx, int32_t l, int64_t ts, const double* values,
                KeyLogs& logs, std::vector<WindowState>& states) {
  const LogSpec& spec = ctx.group.logs[static_cast<size_t>(l)];
  KeyLog& log = logs[static_cast<size_t>(l)];
  EventLog& arrival = log.arrival;
  const bool short_counts = spec.keep <= kScanRows;
  // Time windows read the arrival ring while the key has no sorted ring (see KeyLog).
  const bool scanned = spec.reach >= 0 && short_counts && log.sorted.empty();
  if (scanned) {
    arrival.push(ts, values, spec.columns.data());
    const int64_t horizon = ctx.watermark - ctx.lateness - spec.reach;
    while (arrival.size() > static_cast<size_t>(spec.keep) && arrival.ts(arrival.begin()) < horizon) {
      arrival.pop_front();
    }
    if (arrival.size() <= static_cast<size_t>(kScanRows)) return;
    build_sorted(ctx, l, logs, states);
    while (arrival.size() > static_cast<size_t>(spec.keep)) arrival.pop_front();
    return;
  }
  if (spec.keep > 0) {
    arrival.push(ts, values, spec.columns.data());
    // Short count windows are scanned, so they need only their rows. Longer ones are
    // trimmed in steps, so a count window read again soon catches up row by row.
    if (short_counts) {
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
  const auto at = static_cast<size_t>(ctx.group.window_base + w);
  if (scratch.reads.size() <= at) scratch.reads.resize(at + 1);
  WindowRead& r = scratch.reads[at];
  if (r.stamp == stamp) return r;
  r.stamp = stamp;
  const WindowSpec& window = ctx.group.windows[static_cast<size_t>(w)];
  if (r.out.size() != static_cast<size_t>(window.n_out)) r.out.resize(static_cast<size_t>(window.n_out));
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
