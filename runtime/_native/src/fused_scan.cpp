// A trigger's scanned windows read straight into its feature row: each part meets its
// rows with the loops and arithmetic its own window's scan uses (scan_rows.hpp), so
// every output has the same bits; without the per-window dispatch, output buffers and
// stamps of query_window.
#include "fused_scan.hpp"

#include <algorithm>

#include "scan_rows.hpp"

namespace skiff::stream {

bool scan_features(const CompiledTrigger& trigger, const KeyLogs& logs, int64_t lateness,
                   int64_t ts, double* out, int64_t& lo, int64_t& hi) {
  const ScanPlan& plan = trigger.scan;
  const KeyLog& key_log = logs[static_cast<size_t>(plan.log)];
  if (plan.time && !key_log.sorted.empty()) return false;
  const EventLog& log = key_log.arrival;
  lo = kMax;
  hi = kMin;
  for (const ScanPart& sp : plan.parts) {
    int64_t w_lo = kMax, w_hi = kMin;  // none, until a window says
    if (sp.kind == WindowKind::Count) {  // as scan_count
      const auto loop = [&](auto&& take) { return count_rows(log, sp.size, w_lo, w_hi, take); };
      out[sp.offset] = one_stat(sp.agg, sp.column, loop);
    } else {  // as query_window's scan_arrival
      int64_t wl = ts - sp.size + 1, wh = ts;
      if (sp.kind == WindowKind::Tumbling) {
        wh = ts / sp.size * sp.size - 1;  // ts >= 0, so this is floor division
        wl = wh + 1 - sp.size;
      }
      const auto loop = [&](auto&& take) { return arrival_rows(log, wl, wh, lateness, take); };
      out[sp.offset] = one_stat(sp.agg, sp.column, loop);
      w_lo = wl;
      w_hi = wh + 1;
    }
    if (w_lo <= w_hi) {
      lo = std::min(lo, w_lo);
      hi = std::max(hi, w_hi);
    }
  }
  if (lo > hi) {  // no window contributed bounds: the firing event alone
    lo = ts;
    hi = ts + 1;
  }
  return true;
}

}  // namespace skiff::stream
