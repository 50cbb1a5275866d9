// ParkedWaits: the parked callbacks of a blocking wait (the token queue, the ssp gate) — ids for
// cancellation, FIFO order, and a closed state that fails present and future waits.
//
// Thread-safety: none; the owner guards it with its own lock and runs callbacks outside it.
#ifndef PSD_SERVER_CORE_PARKED_WAITS_H_
#define PSD_SERVER_CORE_PARKED_WAITS_H_

#include <cstdint>
#include <functional>
#include <list>
#include <optional>

#include "psd/status.h"

namespace psd::server {

template <typename Key>
class ParkedWaits {
 public:
  using Callback = std::function<void(Status status, int64_t value)>;
  struct Waiter {
    uint64_t id;
    Key key;
    Callback cb;
  };

  // Parks a callback; returns its id (never 0).
  uint64_t Park(Key key, Callback cb) {
    uint64_t id = next_id_++;
    waiters_.push_back({id, std::move(key), std::move(cb)});
    return id;
  }

  // Removes the waiter `id`; nullopt if it is no longer parked (already released).
  std::optional<Waiter> Remove(uint64_t id) {
    for (auto it = waiters_.begin(); it != waiters_.end(); ++it) {
      if (it->id == id) {
        Waiter w = std::move(*it);
        waiters_.erase(it);
        return w;
      }
    }
    return std::nullopt;
  }

  bool Contains(uint64_t id) const {
    for (const Waiter& w : waiters_) {
      if (w.id == id) return true;
    }
    return false;
  }

  // Marks the wait closed with `why` and hands back everything parked. False if already closed.
  bool Close(Status why, std::list<Waiter>* parked) {
    if (closed_) return false;
    closed_ = true;
    close_status_ = std::move(why);
    parked->swap(waiters_);
    return true;
  }

  bool closed() const { return closed_; }
  const Status& close_status() const { return close_status_; }
  std::list<Waiter>& waiters() { return waiters_; }
  const std::list<Waiter>& waiters() const { return waiters_; }

 private:
  std::list<Waiter> waiters_;
  uint64_t next_id_ = 1;
  bool closed_ = false;
  Status close_status_;
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_PARKED_WAITS_H_
