#include "net/frame_budget.h"

#include <algorithm>

namespace psd::server {

void FrameBudget::Acquire(uint64_t bytes, std::function<void()> granted) {
  {
    MutexLock lock(&mu_);
    if (!waiters_.empty() || !FitsLocked(bytes)) {
      ++waits_;
      waiters_.push_back({bytes, std::move(granted)});
      std::map<uint64_t, std::function<void()>> idle;
      idle.swap(idle_);
      lock.Unlock();
      for (auto& [holder, reclaim] : idle) reclaim();
      return;
    }
    in_use_ += bytes;
    peak_ = std::max(peak_, in_use_);
  }
  granted();
}

void FrameBudget::Release(uint64_t bytes) {
  std::deque<Waiter> ready;
  {
    MutexLock lock(&mu_);
    in_use_ -= std::min(bytes, in_use_);
    GrantLocked(&ready);
  }
  for (auto& w : ready) w.granted();
}

void FrameBudget::GrantLocked(std::deque<Waiter>* ready) {
  while (!waiters_.empty() && FitsLocked(waiters_.front().bytes)) {
    in_use_ += waiters_.front().bytes;
    peak_ = std::max(peak_, in_use_);
    ready->push_back(std::move(waiters_.front()));
    waiters_.pop_front();
  }
}

bool FrameBudget::OfferIdle(uint64_t holder, std::function<void()> reclaim) {
  MutexLock lock(&mu_);
  if (!waiters_.empty()) return false;
  idle_[holder] = std::move(reclaim);
  return true;
}

void FrameBudget::Withdraw(uint64_t holder) {
  MutexLock lock(&mu_);
  idle_.erase(holder);
}

uint64_t FrameBudget::in_use() const {
  MutexLock lock(&mu_);
  return in_use_;
}

uint64_t FrameBudget::peak() const {
  MutexLock lock(&mu_);
  return peak_;
}

uint64_t FrameBudget::waits() const {
  MutexLock lock(&mu_);
  return waits_;
}

size_t FrameBudget::waiting() const {
  MutexLock lock(&mu_);
  return waiters_.size();
}

}  // namespace psd::server
