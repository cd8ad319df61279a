#include "features.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace skiff::stream {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Calls visit(pos) for every row of `log` in the feature's window, newest first.
template <class Visit>
void scan(const EventLog& log, const CompiledFeature& f, int64_t ts, int64_t lateness,
          int64_t& lo, int64_t& hi, Visit&& visit) {
  const size_t n = log.size();
  if (f.window == WindowKind::Count) {
    const size_t m = std::min(n, static_cast<size_t>(f.size));
    for (size_t i = 0; i < m; ++i) {
      const size_t pos = log.pos(i);
      lo = std::min(lo, log.ts_at(pos));
      hi = std::max(hi, log.ts_at(pos) + 1);
      visit(pos);
    }
    return;
  }
  int64_t start = ts - f.size + 1, end = ts + 1;
  if (f.window == WindowKind::Tumbling) {
    end = ts / f.size * f.size;  // ts >= 0, so this is floor division
    start = end - f.size;
  }
  lo = std::min(lo, start);
  hi = std::max(hi, end);
  // Every event arrives no more than `lateness` behind the watermark, which is at least
  // the ts of everything that arrived before it. So once a row is older than
  // start - lateness, so is every row that arrived before it: stop there.
  const int64_t stop = start - lateness;
  for (size_t i = 0; i < n; ++i) {
    const size_t pos = log.pos(i);
    const int64_t t = log.ts_at(pos);
    if (t < stop) break;
    if (t >= start && t < end) visit(pos);
  }
}

void histogram(const EventLog& log, const CompiledFeature& f, const double* e, size_t n_edges,
               int64_t ts, int64_t lateness, int64_t& lo, int64_t& hi, double* out) {
  const size_t bins = n_edges - 1;
  std::fill(out, out + bins, 0.0);
  scan(log, f, ts, lateness, lo, hi, [&](size_t pos) {
    const double v = log.value_at(pos, f.column);
    if (v < e[0] || v > e[bins]) return;
    // numpy's convention: bins are [e_i, e_i+1) except the last, which is closed.
    const size_t bin = v == e[bins] ? bins - 1 : std::upper_bound(e, e + n_edges, v) - e - 1;
    out[bin] += 1.0;
  });
}

double aggregate(const EventLog& log, const CompiledFeature& f, int64_t ts, int64_t lateness,
                 int64_t& lo, int64_t& hi, std::vector<double>& scratch) {
  const int32_t col = f.column;
  double sum = 0;
  int64_t n = 0;
  switch (f.agg) {
    case Agg::Count:
      scan(log, f, ts, lateness, lo, hi, [&](size_t) { ++n; });
      return static_cast<double>(n);
    case Agg::Sum:
    case Agg::Mean:
    case Agg::Std: {
      scan(log, f, ts, lateness, lo, hi, [&](size_t pos) {
        sum += log.value_at(pos, col);
        ++n;
      });
      if (f.agg == Agg::Sum) return sum;
      if (n == 0) return kNaN;
      const double mean = sum / static_cast<double>(n);
      if (f.agg == Agg::Mean) return mean;
      double dev = 0;  // two passes: stable for values far from zero
      scan(log, f, ts, lateness, lo, hi, [&](size_t pos) {
        const double d = log.value_at(pos, col) - mean;
        dev += d * d;
      });
      return std::sqrt(dev / static_cast<double>(n));
    }
    case Agg::Min:
    case Agg::Max: {
      double best = kNaN;
      const bool is_min = f.agg == Agg::Min;
      scan(log, f, ts, lateness, lo, hi, [&](size_t pos) {
        const double v = log.value_at(pos, col);
        if (std::isnan(best) || (is_min ? v < best : v > best)) best = v;
      });
      return best;
    }
    case Agg::Last: {
      double value = kNaN;
      int64_t best = kNone;
      // Newest first, so a strict comparison keeps the latest arrival among equal ts.
      scan(log, f, ts, lateness, lo, hi, [&](size_t pos) {
        if (log.ts_at(pos) > best) {
          best = log.ts_at(pos);
          value = log.value_at(pos, col);
        }
      });
      return value;
    }
    case Agg::Distinct: {
      scratch.clear();
      scan(log, f, ts, lateness, lo, hi, [&](size_t pos) {
        const double v = log.value_at(pos, col);
        scratch.push_back(v == 0.0 ? 0.0 : v);  // -0.0 and 0.0 are one value
      });
      std::sort(scratch.begin(), scratch.end());
      return static_cast<double>(std::unique(scratch.begin(), scratch.end()) - scratch.begin());
    }
    case Agg::Histogram:
      break;
  }
  return kNaN;
}

}  // namespace

void compute_features(const CompiledTrigger& trigger, const std::vector<EventLog>& logs,
                      const std::vector<double>& edges, int64_t ts, int64_t lateness,
                      double* out, int64_t& lo, int64_t& hi, std::vector<double>& scratch) {
  lo = std::numeric_limits<int64_t>::max();
  hi = std::numeric_limits<int64_t>::min();
  for (const CompiledFeature& f : trigger.features) {
    const EventLog& log = logs[f.log];
    if (f.agg == Agg::Histogram) {
      histogram(log, f, edges.data() + f.edges_begin, f.edges_end - f.edges_begin, ts, lateness,
                lo, hi, out + f.offset);
    } else {
      out[f.offset] = aggregate(log, f, ts, lateness, lo, hi, scratch);
    }
  }
  if (lo > hi) {  // no window contributed bounds: the firing event alone
    lo = ts;
    hi = ts + 1;
  }
}

}  // namespace skiff::stream
