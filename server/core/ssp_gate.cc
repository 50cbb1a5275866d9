#include "core/ssp_gate.h"

#include <algorithm>
#include <vector>

namespace psd::server {

int64_t SspGate::MinClockLocked() const {
  if (clocks_.empty()) return 0;
  int64_t m = clocks_.begin()->second;
  for (auto& [w, c] : clocks_) m = std::min(m, c);
  return m;
}

void SspGate::Join(uint32_t worker) {
  MutexLock lock(&mu_);
  if (clocks_.count(worker)) return;
  int64_t start = clocks_.empty() ? 0 : MinClockLocked();
  auto it = left_.find(worker);
  if (it != left_.end()) {
    start = std::max(start, it->second);
    left_.erase(it);
  }
  clocks_[worker] = start;
}

void SspGate::Leave(uint32_t worker) {
  MutexLock lock(&mu_);
  auto it = clocks_.find(worker);
  if (it == clocks_.end()) return;
  left_[worker] = it->second;
  clocks_.erase(it);
  ReleaseLocked(lock);
}

SspGate::WaitId SspGate::Advance(uint32_t worker, Callback cb) {
  MutexLock lock(&mu_);
  if (parked_.closed()) {
    Status why = parked_.close_status();
    lock.Unlock();
    cb(why, 0);
    return 0;
  }
  auto it = clocks_.find(worker);
  if (it == clocks_.end()) {
    lock.Unlock();
    cb(FailedPrecondition("worker is not registered for bounded-staleness training"), 0);
    return 0;
  }
  ++it->second;
  // Others may have been waiting for this worker to move.
  WaitId id = parked_.Park(worker, std::move(cb));
  ReleaseLocked(lock);
  MutexLock again(&mu_);
  return parked_.Contains(id) ? id : 0;  // 0: released at once
}

void SspGate::ReleaseLocked(MutexLock& lock) {
  int64_t min_clock = MinClockLocked();
  std::vector<std::pair<Callback, int64_t>> ready;
  auto& waiters = parked_.waiters();
  for (auto it = waiters.begin(); it != waiters.end();) {
    auto c = clocks_.find(it->key);
    // A worker that left while parked is released too (it no longer waits for anyone).
    int64_t clock = c == clocks_.end() ? min_clock : c->second;
    if (c == clocks_.end() || clock - min_clock <= bound_) {
      ready.emplace_back(std::move(it->cb), clock);
      it = waiters.erase(it);
    } else {
      ++it;
    }
  }
  lock.UnlockFor(&mu_);
  for (auto& [cb, clock] : ready) cb(Status::Ok(), clock);
}

bool SspGate::Cancel(WaitId id, const Status& why) {
  MutexLock lock(&mu_);
  auto w = parked_.Remove(id);
  if (!w) return false;
  // The wait did not complete: the clock step is given back.
  auto c = clocks_.find(w->key);
  if (c != clocks_.end()) --c->second;
  lock.Unlock();
  w->cb(why, 0);
  return true;
}

void SspGate::FailWaiters(const Status& why) {
  MutexLock lock(&mu_);
  std::list<ParkedWaits<uint32_t>::Waiter> parked;
  parked.swap(parked_.waiters());
  for (auto& w : parked) {
    auto c = clocks_.find(w.key);
    if (c != clocks_.end()) --c->second;
  }
  lock.Unlock();
  for (auto& w : parked) w.cb(why, 0);
}

void SspGate::Close(Status why) {
  MutexLock lock(&mu_);
  std::list<ParkedWaits<uint32_t>::Waiter> parked;
  if (!parked_.Close(why, &parked)) return;
  lock.Unlock();
  for (auto& w : parked) w.cb(why, 0);
}

int64_t SspGate::MinClock() const {
  MutexLock lock(&mu_);
  return MinClockLocked();
}

int64_t SspGate::Clock(uint32_t worker) const {
  MutexLock lock(&mu_);
  auto it = clocks_.find(worker);
  return it == clocks_.end() ? -1 : it->second;
}

}  // namespace psd::server
