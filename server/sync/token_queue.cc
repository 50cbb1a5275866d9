#include "sync/token_queue.h"

#include <vector>

namespace psd::server {

void TokenQueue::Push(int64_t value, int count) {
  std::unique_lock<std::mutex> lock(mu_);
  for (int i = 0; i < count; ++i) tokens_.push_back(value);
  DeliverLocked(lock);
}

void TokenQueue::PushFront(int64_t value) {
  std::unique_lock<std::mutex> lock(mu_);
  tokens_.push_front(value);
  DeliverLocked(lock);
}

void TokenQueue::DeliverLocked(std::unique_lock<std::mutex>& lock) {
  std::vector<std::pair<Callback, int64_t>> ready;
  while (!tokens_.empty() && !waiters_.empty()) {
    ready.emplace_back(std::move(waiters_.front().cb), tokens_.front());
    waiters_.pop_front();
    tokens_.pop_front();
  }
  lock.unlock();
  for (auto& [cb, token] : ready) cb(Status::Ok(), token);
}

TokenQueue::WaitId TokenQueue::Wait(Callback cb) {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) {
    Status why = close_status_;
    lock.unlock();
    cb(why, 0);
    return 0;
  }
  if (!tokens_.empty() && waiters_.empty()) {
    int64_t token = tokens_.front();
    tokens_.pop_front();
    lock.unlock();
    cb(Status::Ok(), token);
    return 0;
  }
  WaitId id = next_id_++;
  waiters_.push_back({id, std::move(cb)});
  return id;
}

bool TokenQueue::Cancel(WaitId id, const Status& why) {
  std::unique_lock<std::mutex> lock(mu_);
  for (auto it = waiters_.begin(); it != waiters_.end(); ++it) {
    if (it->id == id) {
      Callback cb = std::move(it->cb);
      waiters_.erase(it);
      lock.unlock();
      cb(why, 0);
      return true;
    }
  }
  return false;
}

void TokenQueue::Close(Status why) {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) return;
  closed_ = true;
  close_status_ = why;
  std::list<Waiter> parked;
  parked.swap(waiters_);
  lock.unlock();
  for (auto& w : parked) w.cb(why, 0);
}

int64_t TokenQueue::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(tokens_.size());
}

int64_t TokenQueue::waiters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(waiters_.size());
}

bool TokenQueue::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

}  // namespace psd::server
