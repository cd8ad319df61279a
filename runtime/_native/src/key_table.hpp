// Open-addressing hash map (group, int64 key) -> partition slot.
//
// Linear probing with backward-shift deletion, so erasing leaves no tombstones and the
// probe sequences stay short however many keys come and go (keys are evicted all the
// time). Capacity is a power of two kept at most half full.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace skiff::stream {

class KeyTable {
 public:
  KeyTable() { slots_.assign(16, Slot{}); }

  // The slot stored for (group, key), or -1.
  int32_t find(int32_t group, int64_t key) const {
    for (size_t i = hash(group, key) & mask(); ; i = (i + 1) & mask()) {
      const Slot& s = slots_[i];
      if (s.value < 0) return -1;
      if (s.key == key && s.group == group) return s.value;
    }
  }

  // Precondition: (group, key) is absent.
  void insert(int32_t group, int64_t key, int32_t value) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    place(Slot{key, group, value});
    ++size_;
  }

  void erase(int32_t group, int64_t key) {
    size_t i = hash(group, key) & mask();
    while (slots_[i].value >= 0 && !(slots_[i].key == key && slots_[i].group == group)) {
      i = (i + 1) & mask();
    }
    if (slots_[i].value < 0) return;
    // Shift later members of the probe run back so every key stays reachable.
    for (size_t j = (i + 1) & mask(); slots_[j].value >= 0; j = (j + 1) & mask()) {
      const size_t home = hash(slots_[j].group, slots_[j].key) & mask();
      const bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
      if (!stays) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Slot{};
    --size_;
  }

  size_t size() const { return size_; }
  size_t bytes() const { return slots_.capacity() * sizeof(Slot); }

 private:
  struct Slot {
    int64_t key = 0;
    int32_t group = 0;
    int32_t value = -1;  // < 0: empty
  };

  size_t mask() const { return slots_.size() - 1; }

  static uint64_t hash(int32_t group, int64_t key) {
    // splitmix64 finaliser: item ids are often sequential, so mix all bits.
    uint64_t x = static_cast<uint64_t>(key) + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(group) + 1);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }

  void place(const Slot& slot) {
    size_t i = hash(slot.group, slot.key) & mask();
    while (slots_[i].value >= 0) i = (i + 1) & mask();
    slots_[i] = slot;
  }

  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old) {
      if (s.value >= 0) place(s);
    }
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
};

}  // namespace skiff::stream
