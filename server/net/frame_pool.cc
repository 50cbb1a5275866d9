#include "net/frame_pool.h"

#include <sys/mman.h>

#include <new>
#include <utility>
#include <vector>

namespace psd::server {

namespace {

void Unmap(const std::vector<std::pair<void*, uint64_t>>& maps) {
  for (const auto& [p, bytes] : maps) munmap(p, bytes);
}

}  // namespace

FramePool::~FramePool() {
  MutexLock lock(&mu_);
  for (const auto& [bytes, p] : kept_) munmap(p, bytes);
  kept_.clear();
  kept_bytes_ = 0;
}

kj::Array<capnp::word> FramePool::Take(uint64_t words) {
  uint64_t bytes = words * sizeof(capnp::word);
  if (bytes < kMinBytes) return kj::heapArray<capnp::word>(words);
  uint64_t size = (bytes + kGranule - 1) / kGranule * kGranule;
  {
    MutexLock lock(&mu_);
    // The smallest kept buffer that holds the frame, unless it is more than a quarter bigger: the
    // budget charges a frame its own bytes, so what connections hold stays within 1.25 times it
    // (a new mapping replaces a bigger one under the limit).
    auto it = kept_.lower_bound(size);
    if (it != kept_.end() && it->first <= size + size / 4) {
      uint64_t have = it->first;
      void* p = it->second;
      kept_.erase(it);
      kept_bytes_ -= have;
      handed_out_ += have;
      ++reuses_;
      return kj::Array<capnp::word>(static_cast<capnp::word*>(p), have / sizeof(capnp::word), *this);
    }
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  std::vector<std::pair<void*, uint64_t>> unmap;
  {
    MutexLock lock(&mu_);
    handed_out_ += size;
    ++maps_;
    while (!kept_.empty() && handed_out_ + kept_bytes_ > limit_) {
      auto biggest = std::prev(kept_.end());
      unmap.emplace_back(biggest->second, biggest->first);
      kept_bytes_ -= biggest->first;
      kept_.erase(biggest);
    }
  }
  Unmap(unmap);
  return kj::Array<capnp::word>(static_cast<capnp::word*>(p), size / sizeof(capnp::word), *this);
}

void FramePool::disposeImpl(void* first, size_t element_size, size_t element_count, size_t /*capacity*/,
                            void (* /*destroy_element*/)(void*)) const {
  uint64_t bytes = static_cast<uint64_t>(element_size) * element_count;
  {
    MutexLock lock(&mu_);
    handed_out_ -= bytes;
    if (handed_out_ + kept_bytes_ + bytes <= limit_) {
      kept_.emplace(bytes, first);
      kept_bytes_ += bytes;
      return;
    }
  }
  munmap(first, bytes);
}

uint64_t FramePool::handed_out_bytes() const {
  MutexLock lock(&mu_);
  return handed_out_;
}

uint64_t FramePool::kept_bytes() const {
  MutexLock lock(&mu_);
  return kept_bytes_;
}

uint64_t FramePool::maps() const {
  MutexLock lock(&mu_);
  return maps_;
}

uint64_t FramePool::reuses() const {
  MutexLock lock(&mu_);
  return reuses_;
}

}  // namespace psd::server
