// Aggregations over one key's windows, computed when a trigger fires.
#pragma once

#include <cstdint>
#include <vector>

#include "compiled.hpp"
#include "event_log.hpp"

namespace skiff::stream {

// Writes the trigger's feature vector to `out` (trigger.width doubles) and the hull of
// its windows to [lo, hi). `scratch` is reused between calls (distinct counts).
//
// Each feature scans its own window: a scan stops at the first row too old for that
// window, so separate short scans beat one fused scan as deep as the deepest window.
void compute_features(const CompiledTrigger& trigger, const std::vector<EventLog>& logs,
                      const std::vector<double>& edges, int64_t ts, int64_t lateness,
                      double* out, int64_t& lo, int64_t& hi, std::vector<double>& scratch);

}  // namespace skiff::stream
