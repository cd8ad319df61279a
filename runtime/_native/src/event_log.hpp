// One key's events of one stream (all types, or one type) in arrival order.
//
// A ring buffer of rows [ts, value...] in one flat array of 8-byte words: appending
// never allocates once the ring has grown to the key's steady-state size, and a row is
// one cache line or two.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace skiff::stream {

class EventLog {
 public:
  explicit EventLog(size_t columns) : stride_(columns + 1) {}

  void push(int64_t ts, const double* values, const int32_t* columns) {
    if (size_ == capacity_) grow();
    int64_t* row = words_.data() + ((head_ + size_) & (capacity_ - 1)) * stride_;
    row[0] = ts;
    for (size_t c = 0; c + 1 < stride_; ++c) std::memcpy(row + 1 + c, values + columns[c], 8);
    ++size_;
  }

  // Drop the oldest rows while more than `keep` remain and the oldest is before `horizon`.
  void evict(int64_t horizon, size_t keep) {
    while (size_ > keep && words_[head_ * stride_] < horizon) {
      head_ = (head_ + 1) & (capacity_ - 1);
      --size_;
    }
  }

  void clear() { head_ = size_ = 0; }
  size_t size() const { return size_; }
  size_t bytes() const { return words_.capacity() * sizeof(int64_t); }

  // Calls visit(row) on at most `limit` rows, newest first, while it returns true. A row
  // is `ts` then the stored values (read them with `value`); the ring is walked as at
  // most two contiguous runs, so the loop is a pointer decrement per row.
  template <class Visit>
  void visit_newest(size_t limit, Visit&& visit) const {
    size_t left = std::min(limit, size_);
    size_t at = (head_ + size_ - 1) & (capacity_ - 1);
    while (left) {
      const size_t run = std::min(left, at + 1);
      const int64_t* first = words_.data() + at * stride_;
      for (size_t k = 0; k < run; ++k) {
        if (!visit(first - k * stride_)) return;
      }
      left -= run;
      at = capacity_ - 1;
    }
  }

  static double value(const int64_t* row, size_t column) {
    double v;
    std::memcpy(&v, row + 1 + column, sizeof v);
    return v;
  }

 private:
  void grow() {
    const size_t cap = capacity_ ? capacity_ * 2 : 8;
    std::vector<int64_t> words(cap * stride_);
    for (size_t i = 0; i < size_; ++i) {
      const size_t from = (head_ + i) & (capacity_ - 1);
      std::memcpy(&words[i * stride_], &words_[from * stride_], stride_ * sizeof(int64_t));
    }
    words_.swap(words);
    capacity_ = cap;
    head_ = 0;
  }

  size_t stride_;              // words per row: ts, then the stored value columns
  std::vector<int64_t> words_;  // capacity_ rows, capacity_ a power of two (or zero)
  size_t capacity_ = 0;
  size_t head_ = 0;
  size_t size_ = 0;
};

}  // namespace skiff::stream
