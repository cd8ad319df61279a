// C++ tests of the stream core, run under ASan/UBSan by `make sanitize`.
//
// Semantics are checked against the Python reference by tests/runtime (hypothesis);
// here the point is memory safety: hand-checked cases, every input error, and a long
// randomized stress over eviction, slot reuse, ring growth and many keys.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <unordered_map>

#include "exact.hpp"
#include "key_table.hpp"
#include "stream_core.hpp"

using namespace skiff::stream;

namespace {

int failures = 0;

#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

Config config(int32_t n_types, int32_t n_keys, int32_t n_values) {
  Config c;
  c.n_types = n_types;
  c.n_keys = n_keys;
  c.n_values = n_values;
  for (int32_t v = 0; v < n_values; ++v) c.value_names.push_back("v" + std::to_string(v));
  return c;
}

void add_event(Batch& b, int64_t ts, int32_t type, std::vector<int64_t> keys, std::vector<double> values) {
  b.ts.push_back(ts);
  b.types.push_back(type);
  b.keys.insert(b.keys.end(), keys.begin(), keys.end());
  b.values.insert(b.values.end(), values.begin(), values.end());
}

StepDef step(int32_t type, Op op) { return StepDef{type, op, {}}; }

void test_contiguous_and_gap() {
  Engine engine(config(3, 1, 1));
  TriggerDef contiguous{0, -1, {step(0, Op::Contiguous), step(1, Op::Contiguous)}, {}};
  TriggerDef gap{0, 10, {step(0, Op::Contiguous), step(1, Op::Gap)}, {}};
  gap.features.push_back(FeatureDef{Agg::Sum, 0, WindowKind::Sliding, 100, -1, {}});
  CHECK(engine.add_trigger(contiguous) == 0);
  CHECK(engine.add_trigger(gap) == 1);
  Batch b;
  add_event(b, 0, 0, {7}, {1.0});   // a
  add_event(b, 1, 2, {7}, {2.0});   // c breaks contiguity
  add_event(b, 2, 1, {7}, {4.0});   // b: gap fires (span 2 <= 10), contiguous does not
  add_event(b, 3, 0, {8}, {8.0});   // a of another key
  add_event(b, 4, 1, {8}, {16.0});  // b: both fire for key 8
  add_event(b, 20, 1, {7}, {0.5});  // b: span 20 > 10, nothing
  Firings out;
  engine.push(b, out);
  CHECK((out.trigger_id == std::vector<int32_t>{1, 0, 1}));
  CHECK((out.event_index == std::vector<int64_t>{2, 4, 4}));
  CHECK((out.key == std::vector<int64_t>{7, 8, 8}));
  const std::vector<double>* gap_rows = out.matrix(1);
  CHECK(gap_rows && gap_rows->size() == 2 && (*gap_rows)[0] == 7.0 && (*gap_rows)[1] == 24.0);
  CHECK(out.window_start[0] == 2 - 100 + 1 && out.window_end[0] == 3);
  engine.remove_trigger(0);
  bool threw = false;
  try {
    engine.remove_trigger(0);  // already removed
  } catch (const StateError&) {
    threw = true;
  }
  CHECK(threw);
  CHECK(engine.add_trigger(contiguous) == 2);  // mid-stream: fresh state, a new id
  Batch more;
  add_event(more, 21, 1, {8}, {1.0});
  add_event(more, 22, 0, {8}, {1.0});
  add_event(more, 23, 1, {8}, {1.0});  // a -> b: the gap trigger and the new one, not 0
  Firings out2;
  engine.push(more, out2);
  CHECK((out2.trigger_id == std::vector<int32_t>{1, 2}));
  CHECK((out2.event_index == std::vector<int64_t>{2, 2}));
}

void expect_rejected(Engine& engine, const Batch& b, InputError::Kind kind, size_t index) {
  const Stats before = engine.stats();
  Firings out;
  bool threw = false;
  try {
    engine.push(b, out);
  } catch (const InputError& e) {
    threw = e.kind == kind && e.index == index;
  }
  CHECK(threw);
  const Stats after = engine.stats();
  CHECK(after.events == before.events && after.live_events == before.live_events);
  CHECK(after.watermark == before.watermark && after.live_keys == before.live_keys);
}

void test_input_errors() {
  Config c = config(2, 1, 1);
  c.lateness = 5;
  Engine engine(c);
  engine.add_trigger(TriggerDef{0, -1, {step(0, Op::Contiguous)},
                                {FeatureDef{Agg::Count, -1, WindowKind::Count, 3, -1, {}}}});
  Batch ok;
  add_event(ok, 100, 0, {1}, {1.0});
  Firings out;
  engine.push(ok, out);
  Batch late = ok;
  add_event(late, 94, 0, {1}, {1.0});
  expect_rejected(engine, late, InputError::Kind::Late, 1);
  Batch type = ok;
  add_event(type, 100, 2, {1}, {1.0});
  expect_rejected(engine, type, InputError::Kind::UnknownType, 1);
  Batch nan;
  add_event(nan, 100, 0, {1}, {std::nan("")});
  expect_rejected(engine, nan, InputError::Kind::NonFinite, 0);
  Batch inf;
  add_event(inf, 100, 0, {1}, {-INFINITY});
  expect_rejected(engine, inf, InputError::Kind::NonFinite, 0);
  Batch negative;
  add_event(negative, -1, 0, {1}, {1.0});
  expect_rejected(engine, negative, InputError::Kind::TimestampRange, 0);
  Batch in_lateness;
  add_event(in_lateness, 95, 0, {1}, {1.0});
  engine.push(in_lateness, out);
  CHECK(engine.stats().events == 2);
}

void test_key_table() {
  std::mt19937_64 rng(7);
  KeyTable table;
  std::unordered_map<int64_t, int32_t> model;
  for (int i = 0; i < 200000; ++i) {
    const int64_t key = static_cast<int64_t>(rng() % 5000) - 2500;
    const auto it = model.find(key);
    CHECK(table.find(key & 1, key) == (it == model.end() ? -1 : it->second));
    if (it == model.end()) {
      table.insert(static_cast<int32_t>(key & 1), key, i);
      model[key] = i;
    } else if (rng() % 2) {
      table.erase(static_cast<int32_t>(key & 1), key);
      model.erase(it);
    }
  }
  CHECK(table.size() == model.size());
}

TriggerDef random_trigger(std::mt19937_64& rng, const Config& c) {
  auto pick = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); };
  TriggerDef t;
  t.by = static_cast<int32_t>(pick(c.n_keys));
  t.within = pick(3) ? pick(200) : -1;
  for (int64_t j = 0, n = 1 + pick(4); j < n; ++j) {
    StepDef s = step(static_cast<int32_t>(pick(c.n_types)), pick(2) ? Op::Gap : Op::Contiguous);
    if (pick(3) == 0) {
      s.conditions.push_back(Condition{true, static_cast<int32_t>(pick(c.n_values)),
                                       static_cast<Cmp>(pick(6)), static_cast<double>(pick(5)), 0});
    }
    if (pick(3) == 0) {
      s.conditions.push_back(Condition{false, static_cast<int32_t>(pick(c.n_keys)),
                                       static_cast<Cmp>(pick(6)), 0, pick(4)});
    }
    t.steps.push_back(s);
  }
  for (int64_t j = 0, n = pick(5); j < n; ++j) {
    FeatureDef f{static_cast<Agg>(pick(9)), 0, static_cast<WindowKind>(pick(3)), 1 + pick(60),
                 pick(2) ? -1 : static_cast<int32_t>(pick(c.n_types)), {}};
    f.field = f.agg == Agg::Count ? -1 : static_cast<int32_t>(pick(c.n_values));
    if (f.agg == Agg::Histogram) f.edges = {-1.0, 0.5, 2.0, 4.0};
    t.features.push_back(f);
  }
  return t;
}

Batch random_batch(std::mt19937_64& rng, const Config& c, int64_t base) {
  Batch batch;
  for (int i = 0, n = static_cast<int>(rng() % 300); i < n; ++i) {
    base += static_cast<int64_t>(rng() % 4);
    const int64_t ts = std::max<int64_t>(0, base - static_cast<int64_t>(rng() % (c.lateness + 1)));
    std::vector<int64_t> keys;
    std::vector<double> values;
    for (int k = 0; k < c.n_keys; ++k) keys.push_back(static_cast<int64_t>(rng() % 20));
    for (int v = 0; v < c.n_values; ++v) values.push_back(static_cast<double>(rng() % 9) / 2 - 1);
    add_event(batch, ts, static_cast<int32_t>(rng() % static_cast<uint64_t>(c.n_types)), keys, values);
  }
  return batch;
}

void test_random_stress() {
  std::mt19937_64 rng(12345);
  for (int round = 0; round < 60; ++round) {
    Config c = config(1 + static_cast<int32_t>(rng() % 5), 1 + static_cast<int32_t>(rng() % 3),
                      1 + static_cast<int32_t>(rng() % 3));
    c.lateness = static_cast<int64_t>(rng() % 40);
    c.max_keys = 1 + static_cast<int64_t>(rng() % 50);
    c.ttl = rng() % 2 ? static_cast<int64_t>(rng() % 300) : -1;
    Engine engine(c);
    std::vector<int32_t> widths;
    for (int t = 0, n = 1 + static_cast<int>(rng() % 20); t < n; ++t) {
      engine.add_trigger(random_trigger(rng, c));
      widths.push_back(engine.trigger_width(t));
    }
    int64_t base = 0;
    for (int b = 0; b < 20; ++b) {
      Batch batch;
      for (int i = 0, n = static_cast<int>(rng() % 500); i < n; ++i) {
        base += static_cast<int64_t>(rng() % 4);
        const int64_t ts = std::max<int64_t>(0, base - static_cast<int64_t>(rng() % (c.lateness + 1)));
        std::vector<int64_t> keys;
        std::vector<double> values;
        for (int k = 0; k < c.n_keys; ++k) keys.push_back(static_cast<int64_t>(rng() % 200));
        for (int v = 0; v < c.n_values; ++v) values.push_back(static_cast<double>(rng() % 9) / 2 - 1);
        add_event(batch, ts, static_cast<int32_t>(rng() % static_cast<uint64_t>(c.n_types)), keys, values);
      }
      Firings out;
      engine.push(batch, out);
      for (size_t i = 0; i < out.fired.size(); ++i) {
        CHECK(out.matrices[i].size() == static_cast<size_t>(out.rows[i] * widths[out.fired[i]]));
      }
      for (size_t i = 0; i < out.trigger_id.size(); ++i) {
        CHECK(out.window_start[i] < out.window_end[i]);
        CHECK(i == 0 || out.event_index[i - 1] <= out.event_index[i]);
      }
      CHECK(engine.stats().live_keys <= c.max_keys);
    }
  }
}

bool same_firings(const Firings& a, const Firings& b) {
  if (a.trigger_id != b.trigger_id || a.key != b.key || a.event_index != b.event_index ||
      a.window_start != b.window_start || a.window_end != b.window_end || a.fired != b.fired) {
    return false;
  }
  for (size_t i = 0; i < a.fired.size(); ++i) {
    for (size_t j = 0; j < a.matrices[i].size(); ++j) {
      const double x = a.matrices[i][j], y = b.matrices[i][j];
      if (!(x == y || std::fabs(x - y) <= 1e-9 * std::fabs(y) || (std::isnan(x) && std::isnan(y)))) return false;
    }
  }
  return true;
}

// A restored engine fires like one that never stopped; damaged payloads (truncated,
// bit-flipped) are refused with SnapshotError or restore some other valid state, and
// the engine then keeps working: never a bad memory access (this runs under ASan).
void test_snapshot_restore() {
  std::mt19937_64 rng(777);
  for (int round = 0; round < 30; ++round) {
    Config c = config(1 + static_cast<int32_t>(rng() % 4), 1 + static_cast<int32_t>(rng() % 2), 2);
    c.lateness = static_cast<int64_t>(rng() % 20);
    c.max_keys = 1 + static_cast<int64_t>(rng() % 30);
    Engine a(c), b(c);
    for (int t = 0, n = 1 + static_cast<int>(rng() % 8); t < n; ++t) {
      const TriggerDef def = random_trigger(rng, c);
      a.add_trigger(def);
      b.add_trigger(def);
    }
    const Batch first = random_batch(rng, c, 0), second = random_batch(rng, c, 10'000);
    Firings out;
    a.push(first, out);
    const std::string payload = a.snapshot();
    b.restore(payload);
    CHECK(b.snapshot() == payload);
    Firings want, got;
    a.push(second, want);
    b.push(second, got);
    CHECK(same_firings(got, want));
    for (int damage = 0; damage < 20; ++damage) {
      std::string bad = payload;
      if (damage % 2) {
        bad.resize(rng() % bad.size());
      } else {
        bad[rng() % bad.size()] ^= static_cast<char>(1 << (rng() % 8));
      }
      Engine e(c);
      for (int32_t t = 0; t < a.trigger_count(); ++t) e.add_trigger(random_trigger(rng, c));
      try {
        e.restore(bad);
      } catch (const SnapshotError&) {
      }
      Firings any;
      try {
        e.push(second, any);
      } catch (const InputError&) {  // a flipped watermark can make the batch late
      }
    }
  }
}

void test_running_sum() {
  RunningSum sum;
  for (const double x : {1e16, 1.0, -1e16}) sum.add(x);
  CHECK(sum.value() == 1.0 && sum.trusted() && sum.err() == 0.0);  // naive: 0
  sum.sub(1e16);  // {1, -1e16} after removing the first value
  CHECK(sum.value() == -1e16 + 1.0 || sum.value() == -1e16);
  // Values of mixed magnitude going in and out of a window of 50: the running sum stays
  // within its guarantee of the exact (fsum) sum, or says it cannot vouch for itself.
  std::mt19937_64 rng(3);
  const double pool[] = {1e16, -1e16, 1.0, 0.1, -3.5, 1e-8, 1e16 + 2, 123456.789};
  std::vector<double> window;
  RunningSum running;
  int trusted = 0;
  for (int i = 0; i < 20000; ++i) {
    const double x = pool[rng() % 8];
    window.push_back(x);
    running.add(x);
    if (window.size() > 50) {
      running.sub(window.front());
      window.erase(window.begin());
    }
    ExactSum exact;
    for (const double v : window) exact.add(v);
    if (running.trusted()) {
      ++trusted;
      CHECK(std::fabs(running.value() - exact.value()) <= kRelTol * std::fabs(exact.value()) * 2);
    }
  }
  CHECK(trusted > 1000);
}

void test_long_window_mean() {
  // One key, a mean over a 60 s sliding window and a count(1000) window, checked
  // against sums recomputed exactly, with out-of-order events inside the lateness.
  Config c = config(1, 1, 1);
  c.lateness = 20;
  Engine engine(c);
  TriggerDef t{0, -1, {step(0, Op::Contiguous)}, {}};
  t.features.push_back(FeatureDef{Agg::Sum, 0, WindowKind::Sliding, 60000, -1, {}});
  t.features.push_back(FeatureDef{Agg::Sum, 0, WindowKind::Count, 1000, -1, {}});
  t.features.push_back(FeatureDef{Agg::Max, 0, WindowKind::Sliding, 60000, -1, {}});
  engine.add_trigger(t);
  std::mt19937_64 rng(5);
  std::vector<std::pair<int64_t, double>> seen;
  Batch b;
  for (int64_t i = 0; i < 90000; ++i) {
    const int64_t ts = std::max<int64_t>(0, i - static_cast<int64_t>(rng() % 21));
    const double v = (rng() % 2 ? 1e16 : 1.0) * ((rng() % 3) - 1.0) + static_cast<double>(rng() % 7);
    add_event(b, ts, 0, {0}, {v});
    seen.emplace_back(ts, v);
  }
  Firings out;
  engine.push(b, out);
  CHECK(out.trigger_id.size() == seen.size());
  for (size_t i = 0; i < seen.size(); i += 1499) {
    ExactSum sliding, last;
    double best = -INFINITY;
    for (size_t j = 0; j <= i; ++j) {
      if (seen[j].first > seen[i].first - 60000 && seen[j].first <= seen[i].first) {
        sliding.add(seen[j].second);
        best = std::max(best, seen[j].second);
      }
      if (j + 1000 > i) last.add(seen[j].second);
    }
    const double* row = out.matrices[0].data() + i * 3;
    CHECK(row[0] == sliding.value() || std::fabs(row[0] - sliding.value()) <= 1e-12 * std::fabs(sliding.value()));
    CHECK(row[1] == last.value() || std::fabs(row[1] - last.value()) <= 1e-12 * std::fabs(last.value()));
    CHECK(row[2] == best);
  }
}

}  // namespace

int main() {
  test_running_sum();
  test_long_window_mean();
  test_contiguous_and_gap();
  test_snapshot_restore();
  test_input_errors();
  test_key_table();
  test_random_stress();
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::puts("stream core: all checks passed");
  return 0;
}
