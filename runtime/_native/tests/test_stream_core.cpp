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
  CHECK(out.features[1].size() == 2 && out.features[1][0] == 7.0 && out.features[1][1] == 24.0);
  CHECK(out.window_start[0] == 2 - 100 + 1 && out.window_end[0] == 3);
  bool threw = false;
  try {
    engine.add_trigger(gap);
  } catch (const StateError&) {
    threw = true;
  }
  CHECK(threw);
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
      for (size_t t = 0; t < widths.size(); ++t) {
        CHECK(out.features[t].size() == static_cast<size_t>(out.rows[t] * widths[t]));
      }
      for (size_t i = 0; i < out.trigger_id.size(); ++i) {
        CHECK(out.window_start[i] < out.window_end[i]);
        CHECK(i == 0 || out.event_index[i - 1] <= out.event_index[i]);
      }
      CHECK(engine.stats().live_keys <= c.max_keys);
    }
  }
}

}  // namespace

int main() {
  test_contiguous_and_gap();
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
