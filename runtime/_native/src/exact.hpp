// Floating-point sums that stay exact (or provably close) while values come and go.
//
// A window's running sum sees every value twice: added when it enters, subtracted when
// it leaves. A naive double drifts and cancels badly ([1e16, 1, -1e16] sums to 0);
// `RunningSum` keeps the sum as an unevaluated pair s + c updated with error-free
// transformations, plus a bound on what the pair has lost:
//
// * TwoSum makes s + x == s' + e exactly, so s + c only loses precision when c + e
//   rounds; that loss is computed exactly (TwoSum again) and added to `err`.
// * While err == 0 the pair equals the true sum exactly, so `value()` (s + c rounded
//   once) is the correctly rounded sum: the same double as Python's math.fsum.
// * Otherwise |true - value()| <= err + ulp/2; callers recompute the window exactly
//   (`exact_sum`) when err exceeds kRelTol * |value()|. So every sum is within
//   2**-40 relative of the exact one, and exactly rounded whenever no cancellation
//   below the pair's 106 bits happened (always, for values of similar magnitude).
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

namespace skiff::stream {

constexpr double kRelTol = 0x1p-40;

// a + b == s + e exactly (Knuth's TwoSum: no branch, any magnitudes).
inline void two_sum(double a, double b, double& s, double& e) {
  s = a + b;
  const double bb = s - a;
  e = (a - (s - bb)) + (b - bb);
}

class RunningSum {
 public:
  void add(double x) {
    double t, e, c2, lost;
    two_sum(s_, x, t, e);
    s_ = t;
    two_sum(c_, e, c2, lost);
    c_ = c2;
    // The bound's own rounding is covered by the slack in kRelTol (err is ~2**-100
    // relative to the values for ordinary data).
    err_ += std::fabs(lost);
  }
  void sub(double x) { add(-x); }
  void reset() { s_ = c_ = err_ = 0; }
  void set(double hi, double lo, double err) {
    s_ = hi;
    c_ = lo;
    err_ = err;
  }
  double value() const { return s_ + c_; }
  double hi() const { return s_; }
  double lo() const { return c_; }
  double err() const { return err_; }
  // Whether value() is within kRelTol of the true sum (and not overflowed).
  bool trusted() const {
    const double v = value();
    return std::isfinite(v) && std::isfinite(err_) && err_ <= kRelTol * std::fabs(v);
  }

 private:
  double s_ = 0, c_ = 0, err_ = 0;
};

// Shewchuk's exact summation (as in CPython's math.fsum): the sum as non-overlapping
// partials, then rounded once, so the result is the correctly rounded exact sum.
class ExactSum {
 public:
  void add(double x) {
    size_t i = 0;
    for (double y : partials_) {
      if (std::fabs(x) < std::fabs(y)) std::swap(x, y);
      const double hi = x + y;
      const double lo = y - (hi - x);
      if (lo != 0.0) partials_[i++] = lo;
      x = hi;
    }
    partials_.resize(i);
    partials_.push_back(x);
  }
  void clear() { partials_.clear(); }

  // The correctly rounded sum (round-half-even), CPython's fsum epilogue.
  double value() const {
    size_t n = partials_.size();
    if (n == 0) return 0.0;
    double hi = partials_[--n], lo = 0;
    while (n > 0) {
      const double x = hi;
      const double y = partials_[--n];
      hi = x + y;
      lo = y - (hi - x);
      if (lo != 0.0) break;
    }
    if (n > 0 && ((lo < 0 && partials_[n - 1] < 0) || (lo > 0 && partials_[n - 1] > 0))) {
      const double y = lo * 2;
      const double x = hi + y;
      if (y == x - hi) hi = x;
    }
    return hi;
  }

  // The sum as hi + lo (hi correctly rounded, lo the rounded rest).
  void split(double& hi, double& lo) const {
    hi = value();
    ExactSum rest = *this;
    rest.add(-hi);
    lo = rest.value();
  }

 private:
  std::vector<double> partials_;
};

}  // namespace skiff::stream
