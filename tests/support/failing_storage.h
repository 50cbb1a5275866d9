// FailingStorage: big buffers' storage (core/buffer.h SetBufferStorage) for tests of what runs out
// of memory. While a test holds an ActiveStorage, it refuses the next allocations when told to
// (FailNext: one, or `count`; FailNextOfSize: the next of a size), as memory running out would, and fills what it gives
// with NaN bytes, so a buffer read before it is written shows; inactive, it leaves every buffer to the heap (the other
// tests of a binary run whole). Set for the process at its first use: a binary that sets another storage first (the
// daemon's values segment) makes ActiveStorage's REQUIREs fail, not pass.
#ifndef PSD_TESTS_SUPPORT_FAILING_STORAGE_H_
#define PSD_TESTS_SUPPORT_FAILING_STORAGE_H_

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

#include "core/buffer.h"

namespace psd::testing {

class FailingStorage : public psd::server::BufferStorage {
 public:
  void Activate(bool on) {
    active_ = on;
    fail_next_ = 0;
    fail_size_ = 0;
  }
  void FailNext(int count = 1) { fail_next_ = count; }
  // Refuses the next allocation of exactly `bytes` (0: none), whatever others come before it.
  void FailNextOfSize(size_t bytes) { fail_size_ = bytes; }
  bool armed_for_size() const { return fail_size_ != 0; }
  bool armed() const { return fail_next_ > 0; }
  int left() const { return fail_next_; }  // allocations still to refuse
  void* Allocate(size_t bytes) override {
    if (!active_) return nullptr;
    int left = fail_next_.load();
    while (left > 0 && !fail_next_.compare_exchange_weak(left, left - 1)) {
    }
    if (left > 0) throw std::bad_alloc();
    size_t sized = bytes;
    if (sized != 0 && fail_size_.compare_exchange_strong(sized, 0)) throw std::bad_alloc();
    void* p = std::malloc(bytes);
    if (p == nullptr) return nullptr;
    std::memset(p, 0xff, bytes);
    std::lock_guard<std::mutex> lock(mu_);
    mine_.push_back(p);
    return p;
  }
  bool Free(void* p, size_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find(mine_.begin(), mine_.end(), p);
    if (it == mine_.end()) return false;
    mine_.erase(it);
    std::free(p);
    return true;
  }

 private:
  std::atomic<bool> active_{false};
  std::atomic<int> fail_next_{0};
  std::atomic<size_t> fail_size_{0};
  std::mutex mu_;
  std::vector<void*> mine_;
};

// The storage, active for the scope.
class ActiveStorage {
 public:
  ActiveStorage() : storage_(Storage()) {
    storage_.Activate(true);
    storage_.FailNext();
    // This storage is the one set (a big buffer takes its storage from it).
    REQUIRE_THROWS_AS(psd::server::Buffer(psd::server::kSharedStorageMinBytes), std::bad_alloc);
  }
  ~ActiveStorage() { storage_.Activate(false); }
  FailingStorage* operator->() { return &storage_; }

 private:
  static FailingStorage& Storage() {
    static auto* storage = new FailingStorage;  // lives as long as the process (SetBufferStorage)
    psd::server::SetBufferStorage(storage);
    return *storage;
  }
  FailingStorage& storage_;
};

}  // namespace psd::testing

#endif  // PSD_TESTS_SUPPORT_FAILING_STORAGE_H_
