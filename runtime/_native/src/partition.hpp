// One key's state in one trigger group: matching progress, logs and window states.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "windows.hpp"

namespace skiff::stream {

struct Partition {
  int32_t group = -1;
  int32_t layout = -1;           // group whose log layout `logs` has (slots are reused)
  int32_t last_type = -1;        // type of the key's latest event, -1 before the first
  int64_t key = 0;
  std::vector<int64_t> any;      // per `~>`-parent node: latest start of a match so far
  std::vector<std::pair<int32_t, int64_t>> last;  // (node, start) reached by latest event
  KeyLogs logs;
  std::vector<WindowState> windows;  // per Group::windows
};

}  // namespace skiff::stream
