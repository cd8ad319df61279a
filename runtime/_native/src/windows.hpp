// Per-key window state: running aggregates, so a firing costs the same whatever the
// window's length. State is brought up to date lazily, when a window is read (or a log
// is trimmed), so an event that fires nothing costs only its append to the logs.
//
// * Count windows (last n arrivals) are a FIFO over the arrival-ordered log: each row
//   is added once and removed once (running sums, counts and histogram bins), and
//   monotonic queues give min, max, `last` and the window's ts hull. The log keeps up
//   to 2n rows so a window read again soon after is caught up row by row; one read
//   after more than n arrivals is rebuilt from its n rows (no more than the arrivals).
// * Sliding windows keep their aggregates over the *stable* rows: ts in
//   [watermark - size + 1, watermark - lateness), which no late row can join any more,
//   so they enter and leave in ts order (sums, bins, min/max queues). A firing at t
//   (never more than `lateness` behind the watermark) adds the rows on either side:
//   those within lateness of the watermark, and those between its own start and the
//   stable rows' (as wide as t is late). With lateness 0, nothing.
// * Tumbling windows read a closed bucket: computed once from the sorted log and
//   cached while no late row can still land in it.
// Distinct counts scan the window. Sums are `RunningSum`s (exact.hpp): when one cannot
// vouch for 2**-40 relative accuracy, the window is summed exactly from the log.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "compiled.hpp"
#include "event_log.hpp"
#include "exact.hpp"

namespace skiff::stream {

// Entries (pos, ts, value) in log order, each kept only while no later entry dominates
// it: the front is the extreme of everything pushed since the last pop, and the first
// entry at or after any point is the extreme of everything from there on.
class MonoQueue {
 public:
  struct Entry {
    int64_t pos, ts;
    double value;
  };

  template <class Dominates>
  void push(const Entry& e, Dominates dominates) {
    while (size() && dominates(e, buf_.back())) buf_.pop_back();
    buf_.push_back(e);
  }
  void pop_front() {
    if (++head_ == buf_.size()) {
      clear();
    } else if (head_ >= 32 && 2 * head_ >= buf_.size()) {
      buf_.erase(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
  }
  void clear() {
    buf_.clear();
    head_ = 0;
  }
  size_t size() const { return buf_.size() - head_; }
  const Entry& front() const { return buf_[head_]; }
  // The first entry with ts >= ts (entries in ts order), or nullptr.
  const Entry* first_from(int64_t ts) const;
  size_t bytes() const { return buf_.capacity() * sizeof(Entry); }

 private:
  std::vector<Entry> buf_;
  size_t head_ = 0;
};

// What can be added and removed row by row.
struct Aggregates {
  int64_t n = 0;
  std::vector<RunningSum> sums, sqs;
  std::vector<int64_t> bins;
};

struct WindowState {
  Aggregates agg;                   // over the log's rows at positions [from, to)
  int64_t from = 0, to = 0;
  int64_t lo_ts = 0;                // sliding: the rows' lower ts bound when last synced
  std::vector<MonoQueue> extremes;  // per WindowSpec::extremes, same rows
  MonoQueue first_ts, last_ts;      // count windows: hull and `last`
  int64_t bucket = kNone;           // tumbling: end of the bucket cached in `out`...
  int64_t bucket_wm = 0;            // ...computed at this watermark...
  uint64_t bucket_appends = 0;      // ...and this many appends to the log
  std::vector<double> bucket_out;
};

// A window's outputs at the event being processed, engine-wide (one per window of the
// compiled triggers): computed once per event and key whatever the number of features
// and triggers reading them, and kept out of the per-key state (fewer cache lines).
struct WindowRead {
  uint64_t stamp = 0;      // outputs are those of this event (Engine's per-event stamp)
  int64_t lo = 0, hi = 0;  // ts hull of the outputs' window, lo > hi: none
  std::vector<double> out;
};

// A window of a few rows is read directly: they are a cache line or two, cheaper to
// scan at a firing than running state is to keep up to date at every event.
constexpr int64_t kScanRows = 32;

// Whether a window's one stat can be computed as a scan meets its rows (one_stat,
// scan_rows.hpp), with no rows picked first: all but std, distinct and histograms.
inline bool one_pass(Agg agg) {
  switch (agg) {
    case Agg::Count:
    case Agg::Last:
    case Agg::Sum:
    case Agg::Mean:
    case Agg::Max:
    case Agg::Min: return true;
    default: return false;
  }
}

// A key's rows of one LogSpec: arrival order (count windows), ts order (time windows).
// The sorted ring is built (then kept) only once a key's time windows hold more than
// kScanRows rows: while it is empty the arrival ring keeps every row a time window can
// see, scanned newest first. Most keys never need it, and one ring is fewer cache
// lines per event.
struct alignas(64) KeyLog {  // aligned: both rings' headers in one cache line
  explicit KeyLog(size_t columns) : arrival(columns), sorted(columns) {}
  EventLog arrival, sorted;
  uint64_t appends = 0;  // rows ever appended to `sorted`
  size_t trim_at = 16;   // trim `sorted` when it holds this many rows
};
// A key's logs, one per LogSpec of its group: a view of the KeyLogs in the key's state
// block (partition.hpp), which owns them.
class KeyLogs {
 public:
  KeyLogs() = default;
  KeyLogs(KeyLog* logs, size_t n) : logs_(logs), n_(n) {}
  KeyLog& operator[](size_t i) const { return logs_[i]; }
  size_t size() const { return n_; }
  KeyLog* begin() const { return logs_; }
  KeyLog* end() const { return logs_ + n_; }

 private:
  KeyLog* logs_ = nullptr;
  size_t n_ = 0;
};

// Buffers reused across firings (one per engine).
struct WindowScratch {
  Aggregates agg;
  std::vector<double> values, extremes;
  std::vector<const int64_t*> picked;  // rows a scan found in its window
  std::vector<WindowRead> reads;  // by Group::window_base + window
};

struct WindowContext {
  const Group& group;
  const std::vector<double>& edges;
  int64_t watermark;
  int64_t lateness;
};

// One WindowRead per window of the compiled triggers, each with room for its outputs:
// after every compile (a window keeps its index across compiles).
void size_reads(const Compiled& compiled, WindowScratch& scratch);

// State with nothing in its aggregates yet: for a new key (logs cleared), or after the
// logs were restored (the first read catches up from them).
void reset_windows(const Group& group, const KeyLogs& logs, std::vector<WindowState>& states);

// The key's time-window rows outgrew the arrival ring (KeyLog): moves them to a new
// sorted ring and trims the arrival ring to what count windows keep.
void start_sorted(const WindowContext& ctx, int32_t l, KeyLogs& logs,
                  std::vector<WindowState>& states);

// append_row for a log whose rows are kept in ts order (or a count window's only).
void append_ordered(const WindowContext& ctx, int32_t l, int64_t ts, const double* values,
                    KeyLogs& logs, std::vector<WindowState>& states);

// Appends an event's row to the log `l` and updates the log's windows. Inline: for most
// keys (their time windows' rows still in the arrival ring) this is every event's one
// ring append and trim, which cost less than the call did.
inline void append_row(const WindowContext& ctx, int32_t l, int64_t ts, const double* values,
                       KeyLogs& logs, std::vector<WindowState>& states) {
  const LogSpec& spec = ctx.group.logs[static_cast<size_t>(l)];
  KeyLog& log = logs[static_cast<size_t>(l)];
  // Time windows read the arrival ring while the key has no sorted ring (see KeyLog).
  if (spec.reach < 0 || spec.keep > kScanRows || !log.sorted.empty()) {
    return append_ordered(ctx, l, ts, values, logs, states);
  }
  EventLog& arrival = log.arrival;
  arrival.push(ts, values, spec.columns.data());
  const int64_t horizon = ctx.watermark - ctx.lateness - spec.reach;
  while (arrival.size() > static_cast<size_t>(spec.keep) && arrival.oldest_ts() < horizon) {
    arrival.pop_front();
  }
  if (arrival.size() > static_cast<size_t>(kScanRows)) start_sorted(ctx, l, logs, states);
}

// The outputs of window `w` for a firing at `ts` (cached in `scratch` for this event).
const WindowRead& query_window(const WindowContext& ctx, int32_t w, int64_t ts, uint64_t stamp,
                                const KeyLogs& logs, std::vector<WindowState>& states,
                                WindowScratch& scratch);

}  // namespace skiff::stream
