#include "features.hpp"

#include <algorithm>
#include <limits>

namespace skiff::stream {

void compute_features(const CompiledTrigger& trigger, const WindowContext& ctx, int64_t ts,
                      uint64_t stamp, const KeyLogs& logs, std::vector<WindowState>& states,
                      WindowScratch& scratch, double* out, int64_t& lo, int64_t& hi) {
  lo = std::numeric_limits<int64_t>::max();
  hi = std::numeric_limits<int64_t>::min();
  for (const CompiledFeature& f : trigger.features) {
    const WindowRead& s = query_window(ctx, f.window, ts, stamp, logs, states, scratch);
    // A loop, not std::copy: one or two doubles, where copy calls memmove; most
    // features are one (a histogram is more).
    const double* from = s.out.data() + f.out;
    if (f.width == 1) {
      out[f.offset] = *from;
    } else {
      for (int32_t k = 0; k < f.width; ++k) out[f.offset + k] = from[k];
    }
    if (s.lo <= s.hi) {
      lo = std::min(lo, s.lo);
      hi = std::max(hi, s.hi);
    }
  }
  if (lo > hi) {  // no window contributed bounds: the firing event alone
    lo = ts;
    hi = ts + 1;
  }
}

}  // namespace skiff::stream
