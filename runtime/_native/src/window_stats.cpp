#include "window_stats.hpp"

#include <algorithm>

namespace skiff::stream {

void size_aggregates(const WindowSpec& w, Aggregates& a) {
  a.n = 0;
  refill(a.sums, w.sum_columns.size(), RunningSum{});
  refill(a.sqs, w.sq_columns.size(), RunningSum{});
  refill(a.bins, static_cast<size_t>(w.n_bins), int64_t{0});
}

int64_t bin_of(const double* e, int32_t n_edges, double v) {
  const int32_t bins = n_edges - 1;
  if (v < e[0] || v > e[bins]) return -1;
  if (v == e[bins]) return bins - 1;
  return std::upper_bound(e, e + n_edges, v) - e - 1;
}

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

namespace {

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

}  // namespace

double distinct(const Rows& rows, int32_t column, std::vector<double>& values) {
  values.clear();
  rows.each([&](const int64_t* row) {
    const double v = EventLog::value(row, static_cast<size_t>(column));
    values.push_back(v == 0.0 ? 0.0 : v);  // -0.0 and 0.0 are one value
  });
  std::sort(values.begin(), values.end());
  return static_cast<double>(std::unique(values.begin(), values.end()) - values.begin());
}

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

}  // namespace skiff::stream
