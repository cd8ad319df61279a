// Windows read by scanning a key's few rows at a firing, instead of keeping running
// state: time windows while a key's rows fit the arrival ring (KeyLog), count windows
// of up to kScanRows rows, and sliding windows over a short sorted ring.
#pragma once

#include <cstdint>

#include "windows.hpp"

namespace skiff::stream {

// A sliding window [t - size + 1, t] over a sorted ring of a few rows.
void scan_sliding(const WindowContext& ctx, const WindowSpec& w, WindowRead& r,
                  const EventLog& log, int64_t t, WindowScratch& scratch);

// A time window [lo, hi] over the arrival ring (the key has no sorted ring yet).
void scan_arrival(const WindowContext& ctx, const WindowSpec& w, WindowRead& r,
                  const EventLog& log, int64_t lo, int64_t hi, WindowScratch& scratch);

// A count window: the arrival ring's last `w.size` rows.
void scan_count(const WindowContext& ctx, const WindowSpec& w, WindowRead& r,
                const EventLog& log, WindowScratch& scratch);

}  // namespace skiff::stream
