#include "core/token_queue.h"

#include <vector>

namespace psd::server {

void TokenQueue::Push(int64_t value, int count) {
  MutexLock lock(&mu_);
  for (int i = 0; i < count; ++i) tokens_.push_back(value);
  DeliverLocked(lock);
}

void TokenQueue::PushFront(int64_t value) {
  MutexLock lock(&mu_);
  tokens_.push_front(value);
  DeliverLocked(lock);
}

void TokenQueue::DeliverLocked(MutexLock& lock) {
  std::vector<std::pair<Callback, int64_t>> ready;
  auto& waiters = parked_.waiters();
  while (!tokens_.empty() && !waiters.empty()) {
    ready.emplace_back(std::move(waiters.front().cb), tokens_.front());
    waiters.pop_front();
    tokens_.pop_front();
  }
  lock.UnlockFor(&mu_);
  for (auto& [cb, token] : ready) cb(Status::Ok(), token);
}

TokenQueue::WaitId TokenQueue::Wait(Callback cb) {
  MutexLock lock(&mu_);
  if (parked_.closed()) {
    Status why = parked_.close_status();
    lock.Unlock();
    cb(why, 0);
    return 0;
  }
  if (!tokens_.empty() && parked_.waiters().empty()) {
    int64_t token = tokens_.front();
    tokens_.pop_front();
    lock.Unlock();
    cb(Status::Ok(), token);
    return 0;
  }
  return parked_.Park(NoKey{}, std::move(cb));
}

bool TokenQueue::Cancel(WaitId id, const Status& why) {
  MutexLock lock(&mu_);
  auto w = parked_.Remove(id);
  lock.Unlock();
  if (!w) return false;
  w->cb(why, 0);
  return true;
}

void TokenQueue::FailWaiters(const Status& why) {
  MutexLock lock(&mu_);
  std::list<ParkedWaits<NoKey>::Waiter> parked;
  parked.swap(parked_.waiters());
  lock.Unlock();
  for (auto& w : parked) w.cb(why, 0);
}

void TokenQueue::Close(Status why) {
  MutexLock lock(&mu_);
  std::list<ParkedWaits<NoKey>::Waiter> parked;
  if (!parked_.Close(why, &parked)) return;
  lock.Unlock();
  for (auto& w : parked) w.cb(why, 0);
}

int64_t TokenQueue::size() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(tokens_.size());
}

int64_t TokenQueue::waiters() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(parked_.waiters().size());
}

bool TokenQueue::closed() const {
  MutexLock lock(&mu_);
  return parked_.closed();
}

}  // namespace psd::server
