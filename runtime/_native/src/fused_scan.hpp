// A trigger's features read straight from its key's arrival ring (ScanPlan, compiled.hpp).
#pragma once

#include <cstdint>

#include "compiled.hpp"
#include "windows.hpp"

namespace skiff::stream {

// Writes the features of `trigger` (which has a ScanPlan) and their windows' hull, as
// compute_features would, bit for bit; false (nothing written) if the key's rows are
// not all in the arrival ring (it has a sorted ring and the plan has time windows).
bool scan_features(const CompiledTrigger& trigger, const KeyLogs& logs, int64_t lateness,
                   int64_t ts, double* out, int64_t& lo, int64_t& hi);

}  // namespace skiff::stream
