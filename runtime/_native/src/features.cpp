#include "features.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace skiff::stream {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Calls visit(row) for every row of `log` in the feature's window, newest first.
template <class Visit>
void scan(const EventLog& log, const CompiledFeature& f, int64_t ts, int64_t lateness,
          int64_t& lo, int64_t& hi, Visit&& visit) {
  if (f.window == WindowKind::Count) {
    int64_t first = std::numeric_limits<int64_t>::max(), last = std::numeric_limits<int64_t>::min();
    log.visit_newest(static_cast<size_t>(f.size), [&](const int64_t* row) {
      first = std::min(first, row[0]);
      last = std::max(last, row[0]);
      visit(row);
      return true;
    });
    if (first <= last) {
      lo = std::min(lo, first);
      hi = std::max(hi, last + 1);
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
  log.visit_newest(log.size(), [&](const int64_t* row) {
    const int64_t t = row[0];
    if (t < stop) return false;
    if (t >= start && t < end) visit(row);
    return true;
  });
}

void histogram(const EventLog& log, const CompiledFeature& f, const double* e, size_t n_edges,
               int64_t ts, int64_t lateness, int64_t& lo, int64_t& hi, double* out) {
  const size_t bins = n_edges - 1;
  std::fill(out, out + bins, 0.0);
  scan(log, f, ts, lateness, lo, hi, [&](const int64_t* row) {
    const double v = EventLog::value(row, f.column);
    if (v < e[0] || v > e[bins]) return;
    // numpy's convention: bins are [e_i, e_i+1) except the last, which is closed.
    const size_t bin = v == e[bins] ? bins - 1 : std::upper_bound(e, e + n_edges, v) - e - 1;
    out[bin] += 1.0;
  });
}

double aggregate(const EventLog& log, const CompiledFeature& f, int64_t ts, int64_t lateness,
                 int64_t& lo, int64_t& hi, std::vector<double>& scratch) {
  const size_t col = static_cast<size_t>(f.column);
  double sum = 0;
  int64_t n = 0;
  switch (f.agg) {
    case Agg::Count:
      scan(log, f, ts, lateness, lo, hi, [&](const int64_t*) { ++n; });
      return static_cast<double>(n);
    case Agg::Sum:
    case Agg::Mean:
    case Agg::Std: {
      scan(log, f, ts, lateness, lo, hi, [&](const int64_t* row) {
        sum += EventLog::value(row, col);
        ++n;
      });
      if (f.agg == Agg::Sum) return sum;
      if (n == 0) return kNaN;
      const double mean = sum / static_cast<double>(n);
      if (f.agg == Agg::Mean) return mean;
      double dev = 0;  // two passes: stable for values far from zero
      scan(log, f, ts, lateness, lo, hi, [&](const int64_t* row) {
        const double d = EventLog::value(row, col) - mean;
        dev += d * d;
      });
      return std::sqrt(dev / static_cast<double>(n));
    }
    case Agg::Min:
    case Agg::Max: {
      // Values are finite: start from the first, then keep the extreme.
      double best = kNaN;
      const bool is_min = f.agg == Agg::Min;
      scan(log, f, ts, lateness, lo, hi, [&](const int64_t* row) {
        const double v = EventLog::value(row, col);
        if (n++ == 0 || (is_min ? v < best : v > best)) best = v;
      });
      return best;
    }
    case Agg::Last: {
      double value = kNaN;
      int64_t best = kNone;
      // Newest first, so a strict comparison keeps the latest arrival among equal ts.
      scan(log, f, ts, lateness, lo, hi, [&](const int64_t* row) {
        if (row[0] > best) {
          best = row[0];
          value = EventLog::value(row, col);
        }
      });
      return value;
    }
    case Agg::Distinct: {
      scratch.clear();
      scan(log, f, ts, lateness, lo, hi, [&](const int64_t* row) {
        const double v = EventLog::value(row, col);
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
