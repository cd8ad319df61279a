// One key's rows of one stream (all types, or one type): a ring of rows [ts, value...].
//
// Rows are addressed by absolute position (0 for the first row ever pushed, counting
// on across evictions), so window states can hold positions while old rows leave. A
// ring is used either in arrival order (`push`) or sorted by ts, ties in arrival order
// (`insert_sorted`): an out-of-order row is at most `lateness` behind the watermark, so
// it moves only the few rows newer than it. Appending never allocates once the ring
// has grown to the key's steady-state size.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>

namespace skiff::stream {

class EventLog {
 public:
  explicit EventLog(size_t columns) : stride_(static_cast<uint32_t>(columns + 1)) {}

  // Appends a row; returns its position.
  int64_t push(int64_t ts, const double* values, const int32_t* columns) {
    if (size_ == capacity_) grow();
    write(slot(size_), ts, values, columns);
    ++size_;
    return end() - 1;
  }

  // Inserts a row after every row with ts <= its ts; returns its position.
  int64_t insert_sorted(int64_t ts, const double* values, const int32_t* columns) {
    if (size_ == capacity_) grow();
    size_t at = size_;
    while (at > 0 && slot(at - 1)[0] > ts) {
      std::memcpy(slot(at), slot(at - 1), stride_ * sizeof(int64_t));
      --at;
    }
    write(slot(at), ts, values, columns);
    ++size_;
    return begin_ + static_cast<int64_t>(at);
  }

  // insert_sorted of a row of another ring with the same columns.
  int64_t insert_row(const int64_t* row) {
    if (size_ == capacity_) grow();
    size_t at = size_;
    while (at > 0 && slot(at - 1)[0] > row[0]) {
      std::memcpy(slot(at), slot(at - 1), stride_ * sizeof(int64_t));
      --at;
    }
    std::memcpy(slot(at), row, stride_ * sizeof(int64_t));
    ++size_;
    return begin_ + static_cast<int64_t>(at);
  }

  void pop_front() {
    head_ = (head_ + 1) & (capacity_ - 1);
    --size_;
    ++begin_;
  }

  void clear() {
    begin_ += static_cast<int64_t>(size_);
    head_ = size_ = 0;
  }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t bytes() const { return size_t{capacity_} * stride_ * sizeof(int64_t); }
  size_t columns() const { return stride_ - 1; }
  int64_t begin() const { return begin_; }  // position of the oldest row
  int64_t end() const { return begin_ + static_cast<int64_t>(size_); }

  // Row at absolute position `pos` (begin() <= pos < end()): ts, then the stored values.
  const int64_t* row(int64_t pos) const {
    return words_.get() + ((head_ + static_cast<size_t>(pos - begin_)) & (capacity_ - 1)) * stride_;
  }
  int64_t ts(int64_t pos) const { return row(pos)[0]; }
  int64_t oldest_ts() const { return words_[size_t{head_} * stride_]; }  // not empty()
  double value(int64_t pos, size_t column) const { return value(row(pos), column); }

  static double value(const int64_t* row, size_t column) {
    double v;
    std::memcpy(&v, row + 1 + column, sizeof v);
    return v;
  }

  // First position in [from, end()) whose ts is >= ts (the ring sorted by ts).
  int64_t lower_bound(int64_t from, int64_t ts) const {
    int64_t lo = std::max(from, begin_), hi = end();
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (this->ts(mid) < ts) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    return lo;
  }

  // Rebuilds the ring from raw rows (restore): stride words each, positions from `begin`.
  // `rows` may be unaligned (a snapshot's bytes): it is only read through memcpy.
  void assign(int64_t begin, const void* rows, size_t n) {
    clear();
    while (capacity_ < n) grow();
    if (n) std::memcpy(words_.get(), rows, n * stride_ * sizeof(int64_t));
    head_ = 0;
    size_ = static_cast<uint32_t>(n);
    begin_ = begin;
  }
  size_t stride() const { return stride_; }

 private:
  int64_t* slot(size_t i) { return words_.get() + ((head_ + i) & (capacity_ - 1)) * stride_; }
  const int64_t* slot(size_t i) const {
    return words_.get() + ((head_ + i) & (capacity_ - 1)) * stride_;
  }

  void write(int64_t* row, int64_t ts, const double* values, const int32_t* columns) {
    row[0] = ts;
    switch (stride_) {  // rows of one or two values (most) without the loop
      case 3: std::memcpy(row + 2, values + columns[1], 8); [[fallthrough]];
      case 2: std::memcpy(row + 1, values + columns[0], 8); [[fallthrough]];
      case 1: return;
      default:
        for (size_t c = 0; c + 1 < stride_; ++c) std::memcpy(row + 1 + c, values + columns[c], 8);
    }
  }

  void grow() {
    // Positions in a ring are 32-bit (small fields: two rings share a cache line).
    if (capacity_ >= (uint32_t{1} << 31)) throw std::length_error("stream log too long");
    const uint32_t cap = capacity_ ? capacity_ * 2 : 8;
    std::unique_ptr<int64_t[]> words(new int64_t[size_t{cap} * stride_]);
    for (size_t i = 0; i < size_; ++i) {
      std::memcpy(words.get() + i * stride_, slot(i), stride_ * sizeof(int64_t));
    }
    words_ = std::move(words);
    capacity_ = cap;
    head_ = 0;
  }

  // 32 bytes: a key's two rings fit in one cache line.
  std::unique_ptr<int64_t[]> words_;  // capacity_ rows, capacity_ a power of two (or zero)
  int64_t begin_ = 0;
  uint32_t stride_;  // words per row: ts, then the stored value columns
  uint32_t capacity_ = 0;
  uint32_t head_ = 0;
  uint32_t size_ = 0;
};

}  // namespace skiff::stream
