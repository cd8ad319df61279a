// A trigger's feature vector at a firing, read from its key's window states.
#pragma once

#include <cstdint>
#include <vector>

#include "compiled.hpp"
#include "windows.hpp"

namespace skiff::stream {

// Writes the trigger's feature vector to `out` (trigger.width doubles) and the hull of
// its windows to [lo, hi) ([ts, ts + 1) when no window contributes bounds). Windows
// shared by several features or triggers are computed once per event (`stamp`).
void compute_features(const CompiledTrigger& trigger, const WindowContext& ctx, int64_t ts,
                      uint64_t stamp, const KeyLogs& logs, std::vector<WindowState>& states,
                      WindowScratch& scratch, double* out, int64_t& lo, int64_t& hi);

}  // namespace skiff::stream
