// What a window's outputs are computed from: aggregates over a window's rows (added and
// removed one by one), the exact fallbacks for sums that cannot vouch for themselves,
// and the outputs from them. Private to the window code (windows.cpp, window_scan.cpp,
// scan_rows.hpp and the fused_scan.cpp that uses it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "windows.hpp"

namespace skiff::stream {

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

void size_aggregates(const WindowSpec& w, Aggregates& a);

// numpy's bins: [e_i, e_i+1) except the last, which is closed; -1 outside.
int64_t bin_of(const double* e, int32_t n_edges, double v);

// Adds (sign 1) or removes (sign -1) one row.
void apply_row(const WindowSpec& w, const std::vector<double>& edges, const int64_t* row,
               int sign, Aggregates& a);

// apply_row(+1) without its empty-window branch: what a firing's copy of them takes.
void add_row(const WindowSpec& w, const std::vector<double>& edges, const int64_t* row,
             Aggregates& a);

// Re-sums exactly, from the rows, any running sum that can no longer vouch for itself.
void reseed(const WindowSpec& w, Aggregates& a, const Rows& rows);

// The rows' exact sum of `column`, correctly rounded.
double exact_sum(const Rows& rows, int32_t column);

// Distinct values of `column` among the rows (`values` is scratch).
double distinct(const Rows& rows, int32_t column, std::vector<double>& values);

// Every stat of the window from its aggregates, extremes and `last` row (kNone: none).
void finish(const WindowSpec& w, const Aggregates& a, const Rows& rows, const double* extremes,
            int64_t last, std::vector<double>& values, double* out);

inline bool better(bool is_max, double a, double b) { return is_max ? a >= b : a <= b; }

}  // namespace skiff::stream
