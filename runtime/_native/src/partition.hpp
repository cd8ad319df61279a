// One key's state in one trigger group: matching progress, logs and window states.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <utility>
#include <vector>

#include "compiled.hpp"
#include "windows.hpp"

namespace skiff::stream {

using Reached = std::pair<int32_t, int64_t>;  // (node, start of the match reaching it)

// What every event of a key reads, in one allocation: its logs' headers, then its `last`
// list, then its `any` slots. As three vectors they were three allocations to reach
// through the partition, each with lines of its own; here one, at offsets the group
// fixes. (Window states stay apart: most events never read them.)
class KeyBlock {
 public:
  KeyBlock() = default;
  KeyBlock(const std::vector<LogSpec>& logs, int32_t last_room, int32_t n_any)
      : n_logs_(static_cast<uint32_t>(logs.size())),
        last_room_(static_cast<uint32_t>(last_room)),
        n_any_(static_cast<uint32_t>(n_any)) {
    memory_ = ::operator new(bytes(), std::align_val_t{alignof(KeyLog)});
    KeyLog* log = static_cast<KeyLog*>(memory_);
    for (const LogSpec& spec : logs) new (log++) KeyLog(spec.columns.size());
  }
  KeyBlock(KeyBlock&& other) noexcept { swap(other); }
  KeyBlock& operator=(KeyBlock&& other) noexcept {
    KeyBlock(std::move(other)).swap(*this);
    return *this;
  }
  KeyBlock(const KeyBlock&) = delete;
  KeyBlock& operator=(const KeyBlock&) = delete;
  ~KeyBlock() {
    if (!memory_) return;
    for (KeyLog& log : logs()) log.~KeyLog();
    ::operator delete(memory_, std::align_val_t{alignof(KeyLog)});
  }

  KeyLogs logs() const { return KeyLogs(static_cast<KeyLog*>(memory_), n_logs_); }
  Reached* last() const {
    return reinterpret_cast<Reached*>(static_cast<char*>(memory_) + n_logs_ * sizeof(KeyLog));
  }
  int64_t* any() const { return reinterpret_cast<int64_t*>(last() + last_room_); }
  size_t last_room() const { return last_room_; }
  size_t n_any() const { return n_any_; }
  size_t bytes() const {
    return n_logs_ * sizeof(KeyLog) + last_room_ * sizeof(Reached) + n_any_ * sizeof(int64_t);
  }

 private:
  void swap(KeyBlock& other) noexcept {
    std::swap(memory_, other.memory_);
    std::swap(n_logs_, other.n_logs_);
    std::swap(last_room_, other.last_room_);
    std::swap(n_any_, other.n_any_);
  }

  void* memory_ = nullptr;
  uint32_t n_logs_ = 0, last_room_ = 0, n_any_ = 0;
};
static_assert(sizeof(KeyLog) % alignof(Reached) == 0 && sizeof(Reached) % alignof(int64_t) == 0,
              "the block's parts stay aligned");

// Aligned, with what every event reads first: one cache line a key, not two.
struct alignas(64) Partition {
  // Into `block` (which never moves while the partition keeps it):
  KeyLogs logs;
  int64_t* any = nullptr;   // per `~>`-parent node: latest start of a match so far
  Reached* last = nullptr;  // (node, start) reached by the latest event: n_last of them
  int32_t last_type = -1;   // type of the key's latest event, -1 before the first
  int32_t n_last = 0;       // entries of `last`
  int64_t key = 0;
  // The key's recency, written on every event in the line the event reads anyway (see
  // Engine::Impl::mark), so keeping the keys' LRU order costs no line of its own.
  uint64_t touched = 0;  // the engine's touch count at the key's latest event, 0 if none
  int64_t activity = 0;  // watermark after the key's latest event
  // Not read on an event's path:
  int32_t group = -1;
  int32_t layout = -1;  // group whose layout `block` has (slots are reused)
  KeyBlock block;
  std::vector<WindowState> windows;  // per Group::windows

  // A fresh block laid out for `group` (logs empty, no match state yet).
  void lay_out(const Group& g, int32_t index) {
    block = KeyBlock(g.logs, g.max_reached, g.n_any);
    logs = block.logs();
    any = block.any();
    last = block.last();
    layout = index;
  }
};

}  // namespace skiff::stream
