#include "wire/shared_arena.h"

#include <fcntl.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>
#include <utility>

namespace psd::wire {

Result<std::shared_ptr<SharedArena>> SharedArena::Create(uint64_t bytes, const std::string& name, std::string exhausted,
                                                         uint64_t punch_from) {
  auto segment = SharedSegment::Create(std::max<uint64_t>(ShmAlign(bytes), SharedSegment::kMinBytes), name);
  if (!segment.ok()) return segment.status();
  return std::shared_ptr<SharedArena>(new SharedArena(std::move(*segment), std::move(exhausted), punch_from));
}

Result<std::shared_ptr<SharedArena>> SharedArena::CreateWrittenHereOnly(uint64_t bytes, const std::string& name,
                                                                        std::string exhausted) {
  auto segment = SharedSegment::Create(std::max<uint64_t>(ShmAlign(bytes), SharedSegment::kMinBytes), name,
                                       /*written_here_only=*/true);
  if (!segment.ok()) return segment.status();
  return std::shared_ptr<SharedArena>(new SharedArena(std::move(*segment), std::move(exhausted), UINT64_MAX));
}

SharedArena::SharedArena(std::shared_ptr<SharedSegment> segment, std::string exhausted, uint64_t punch_from)
    : segment_(std::move(segment)), exhausted_(std::move(exhausted)), punch_from_(punch_from) {
  free_[0] = segment_->size();
}

Result<uint64_t> SharedArena::Allocate(uint64_t bytes) {
  const uint64_t need = std::max<uint64_t>(64, ShmAlign(bytes));
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const uint64_t at = it->first;
    const uint64_t left = it->second - need;
    free_.erase(it);
    if (left > 0) free_[at + need] = left;
    used_[at] = need;
    in_use_ += need;
    return at;
  }
  return ResourceExhausted("no room for a block of " + std::to_string(bytes) + " bytes: " + std::to_string(in_use_) +
                           " of " + std::to_string(segment_->size()) + " are in use (" + exhausted_ + ")");
}

void SharedArena::Free(uint64_t offset) {
  uint64_t n = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto used = used_.find(offset);
    if (used == used_.end()) return;
    n = used->second;
  }
  // The pages go back to the system (and read as zeros when handed out again), for this process
  // and the others that map them. Still in used_: no Allocate hands the block out meanwhile.
  if (n >= punch_from_) {
    ::fallocate(segment_->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                static_cast<off_t>(n));
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto used = used_.find(offset);
  if (used == used_.end()) return;
  uint64_t at = offset;
  used_.erase(used);
  in_use_ -= n;
  auto next = free_.lower_bound(at);
  if (next != free_.end() && next->first == at + n) {  // joins the block after
    n += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == at) {  // ... and the one before
      prev->second += n;
      return;
    }
  }
  free_[at] = n;
}

int64_t SharedArena::OffsetOf(const void* p, uint64_t bytes) const {
  const auto b = reinterpret_cast<uintptr_t>(p);
  const auto base = reinterpret_cast<uintptr_t>(segment_->data());
  if (p == nullptr || b < base || b - base > segment_->size()) return -1;
  const uint64_t at = b - base;
  if (bytes > segment_->size() - at) return -1;
  return static_cast<int64_t>(at);
}

uint64_t SharedArena::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

}  // namespace psd::wire
