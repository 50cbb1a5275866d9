#include "core/token_queue.h"

#include <algorithm>
#include <vector>

namespace psd::server {

void TokenQueue::Push(int64_t value, int count) {
  MutexLock lock(&mu_);
  PushLocked(value, count, /*any=*/false);
  DeliverLocked(lock);
}

void TokenQueue::PushInit(int64_t value, int count) {
  MutexLock lock(&mu_);
  PushLocked(value, count, /*any=*/true);
  DeliverLocked(lock);
}

void TokenQueue::PushLocked(int64_t value, int count, bool any) {
  if (!any) {
    // Released tokens two steps old that no wait took belong to workers that are gone (every
    // worker that pushed since takes a newer one): dropped, so they do not pile up step after step.
    tokens_.erase(std::remove_if(tokens_.begin(), tokens_.end(),
                                 [value](const Token& t) { return !t.any && t.value < value - 1; }),
                  tokens_.end());
  }
  for (int i = 0; i < count; ++i) tokens_.push_back({value, any});
}

void TokenQueue::PushFront(int64_t value) {
  MutexLock lock(&mu_);
  tokens_.push_front({value, /*any=*/true});
  DeliverLocked(lock);
}

void TokenQueue::DeliverLocked(MutexLock& lock) {
  std::vector<std::pair<Callback, int64_t>> ready;
  auto& waiters = parked_.waiters();
  // Waiters in FIFO order, each the oldest token it may take.
  for (auto w = waiters.begin(); w != waiters.end() && !tokens_.empty();) {
    auto t = std::find_if(tokens_.begin(), tokens_.end(), [&](const Token& k) { return Takes(w->key, k); });
    if (t == tokens_.end()) {
      ++w;
      continue;
    }
    ready.emplace_back(std::move(w->cb), t->value);
    tokens_.erase(t);
    w = waiters.erase(w);
  }
  lock.UnlockFor(&mu_);
  for (auto& [cb, token] : ready) cb(Status::Ok(), token);
}

TokenQueue::WaitId TokenQueue::Wait(Callback cb, int64_t after) {
  MutexLock lock(&mu_);
  if (parked_.closed()) {
    Status why = parked_.close_status();
    lock.Unlock();
    cb(why, 0);
    return 0;
  }
  // A token queued now is one no parked wait may take (each is handed out as it comes): the oldest
  // this wait may take is its.
  auto t = std::find_if(tokens_.begin(), tokens_.end(), [&](const Token& k) { return Takes(after, k); });
  if (t != tokens_.end()) {
    int64_t token = t->value;
    tokens_.erase(t);
    lock.Unlock();
    cb(Status::Ok(), token);
    return 0;
  }
  return parked_.Park(after, std::move(cb));
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
  std::list<ParkedWaits<int64_t>::Waiter> parked;
  parked.swap(parked_.waiters());
  lock.Unlock();
  for (auto& w : parked) w.cb(why, 0);
}

void TokenQueue::Close(Status why) {
  MutexLock lock(&mu_);
  std::list<ParkedWaits<int64_t>::Waiter> parked;
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
