// The snapshot payload: a key's state as bytes and back, with every read checked.
//
// Layout (little-endian host words; a marker word refuses any other byte order):
//   u32 marker, u8 compiled, i32 open generation, i64 watermark, events, firings,
//   evicted keys; u64 n triggers, then per trigger i32 generation, u8 removed, i64
//   firings; u64 n keys, then per key (least recently used first): i32 group, i64 key,
//   i64 activity, i32 last type, u64 n + i64 `any`, u64 n + (i32 node, i64 start)
//   `last`, and per log of the group: arrival and sorted rings (i64 begin, u64 rows,
//   rows * (1 + columns) words), u64 appends, u64 trim_at.
// Window states are not stored: reset_windows rebuilds them from the logs on first read.
// Restoring never trusts a count or an index: it checks each against the bytes left and
// the compiled triggers, so a damaged payload is a SnapshotError, never a bad access.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "compiled.hpp"
#include "partition.hpp"
#include "stream_core.hpp"

namespace skiff::stream {

constexpr uint32_t kByteOrderMarker = 0x01020304;

class Writer {
 public:
  template <class T>
  void put(T value) {
    char buf[sizeof(T)];
    std::memcpy(buf, &value, sizeof(T));
    out.append(buf, sizeof(T));
  }
  void put_words(const int64_t* words, size_t n) {
    out.append(reinterpret_cast<const char*>(words), n * sizeof(int64_t));
  }
  std::string out;
};

class Reader {
 public:
  explicit Reader(const std::string& data) : p_(data.data()), end_(data.data() + data.size()) {}

  template <class T>
  T get() {
    need(sizeof(T));
    T value;
    std::memcpy(&value, p_, sizeof(T));
    p_ += sizeof(T);
    return value;
  }
  // A count of items of `item_bytes` each, refused if the bytes left cannot hold them.
  size_t count(size_t item_bytes) {
    const auto n = get<uint64_t>();
    if (item_bytes && n > static_cast<uint64_t>(end_ - p_) / item_bytes) fail("count past the end");
    return static_cast<size_t>(n);
  }
  // The next n words, possibly unaligned: read them through memcpy only.
  const char* words(size_t n) {
    need(n * sizeof(int64_t));
    const char* at = p_;
    p_ += n * sizeof(int64_t);
    return at;
  }
  bool done() const { return p_ == end_; }
  [[noreturn]] static void fail(const std::string& what) {
    throw SnapshotError("snapshot payload: " + what);
  }

 private:
  void need(size_t n) {
    if (static_cast<size_t>(end_ - p_) < n) fail("truncated");
  }
  const char* p_;
  const char* end_;
};

inline void save_ring(Writer& w, const EventLog& log) {
  w.put<int64_t>(log.begin());
  w.put<uint64_t>(log.size());
  for (int64_t pos = log.begin(); pos < log.end(); ++pos) w.put_words(log.row(pos), log.stride());
}

// Rows must have ts in [0, watermark], finite values, and (sorted rings) ascending ts.
inline void load_ring(Reader& r, EventLog& log, bool sorted, int64_t watermark, size_t max_rows) {
  const auto begin = r.get<int64_t>();
  const size_t n = r.count(log.stride() * sizeof(int64_t));
  if (begin < 0 || begin > kMaxTs || n > max_rows) Reader::fail("bad log extent");
  const char* rows = r.words(n * log.stride());
  int64_t previous = 0;
  for (size_t i = 0; i < n; ++i) {
    const char* row = rows + i * log.stride() * sizeof(int64_t);
    int64_t ts;
    std::memcpy(&ts, row, sizeof ts);
    if (ts < 0 || ts > watermark || (sorted && ts < previous)) Reader::fail("bad row ts");
    previous = ts;
    for (size_t c = 1; c < log.stride(); ++c) {
      double v;
      std::memcpy(&v, row + c * sizeof(double), sizeof v);
      if (!std::isfinite(v)) Reader::fail("non-finite value in a log");
    }
  }
  log.assign(begin, rows, n);
}

inline void save_partition(Writer& w, const Partition& p, int64_t activity) {
  const size_t n_any = p.block.n_any();
  w.put<int32_t>(p.group);
  w.put<int64_t>(p.key);
  w.put<int64_t>(activity);
  w.put<int32_t>(p.last_type);
  w.put<uint64_t>(n_any);
  for (size_t a = 0; a < n_any; ++a) w.put<int64_t>(p.any[a]);
  w.put<uint64_t>(static_cast<uint64_t>(p.n_last));
  for (int32_t k = 0; k < p.n_last; ++k) {
    w.put<int32_t>(p.last[k].first);
    w.put<int64_t>(p.last[k].second);
  }
  for (const KeyLog& log : p.logs) {
    save_ring(w, log.arrival);
    save_ring(w, log.sorted);
    w.put<uint64_t>(log.appends);
    w.put<uint64_t>(log.trim_at);
  }
}

// Reads a key's state for `group` (already checked to be a live group of `compiled`).
inline void load_partition(Reader& r, const Config& config, const Group& group,
                           int32_t group_index, int64_t watermark, Partition& p,
                           int64_t& activity) {
  p.key = r.get<int64_t>();
  activity = r.get<int64_t>();
  if (activity > watermark) Reader::fail("key active after the watermark");
  p.last_type = r.get<int32_t>();
  if (p.last_type < -1 || p.last_type >= config.n_types) Reader::fail("bad last event type");
  if (r.count(sizeof(int64_t)) != static_cast<size_t>(group.n_any)) Reader::fail("bad match state");
  p.lay_out(group, group_index);
  for (int32_t a = 0; a < group.n_any; ++a) p.any[a] = r.get<int64_t>();
  // No event reaches more nodes than the block has room for (Group::max_reached).
  const size_t n_last = r.count(sizeof(int32_t) + sizeof(int64_t));
  if (n_last > p.block.last_room()) Reader::fail("bad match state");
  p.n_last = static_cast<int32_t>(n_last);
  for (size_t k = 0; k < n_last; ++k) {
    p.last[k].first = r.get<int32_t>();
    p.last[k].second = r.get<int64_t>();
    if (p.last[k].first < 0 || p.last[k].first >= group.n_nodes) Reader::fail("bad trie node");
  }
  for (size_t l = 0; l < group.logs.size(); ++l) {
    const LogSpec& spec = group.logs[l];
    KeyLog& log = p.logs[l];
    // Count windows keep at most 2 * keep + 16 rows, time windows without a sorted ring
    // kScanRows; sorted rings only with a reach.
    const size_t counts = static_cast<size_t>(2 * spec.keep + 16) * (spec.keep > 0);
    load_ring(r, log.arrival, false, watermark,
              std::max(counts, spec.reach < 0 ? size_t{0} : static_cast<size_t>(kScanRows)));
    load_ring(r, log.sorted, true, watermark, spec.reach < 0 ? 0 : SIZE_MAX);
    log.appends = r.get<uint64_t>();
    log.trim_at = r.get<uint64_t>();
    if (log.appends < log.sorted.size() || log.trim_at > (uint64_t{1} << 50)) Reader::fail("bad log counters");
  }
}

}  // namespace skiff::stream
