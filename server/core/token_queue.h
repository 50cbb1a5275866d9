// TokenQueue: the SyncReplicasOptimizer token queue — an unbounded FIFO of global-step values
// that acts as the workers' barrier. A wait either takes a token at once or parks a callback
// (never a thread); the caller bounds every parked wait with a deadline by calling Cancel.
//
// Thread-safety: all methods may be called from any thread; one internal mutex. Callbacks run
// outside the lock, on the thread that delivered the token (Push, Close, Cancel) — they must be
// cheap (post to an executor).
#ifndef PSD_SERVER_CORE_TOKEN_QUEUE_H_
#define PSD_SERVER_CORE_TOKEN_QUEUE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <list>

#include "base/mutex.h"
#include "core/parked_waits.h"
#include "psd/status.h"

namespace psd::server {

class TokenQueue {
 public:
  using Callback = std::function<void(Status status, int64_t token)>;
  using WaitId = uint64_t;

  // Appends `count` tokens carrying `value` and hands them to parked waiters in FIFO order.
  void Push(int64_t value, int count) EXCLUDES(mu_);
  // Puts a token back at the head (a waiter died between delivery and reply).
  void PushFront(int64_t value) EXCLUDES(mu_);

  // Takes a token now (callback runs before Wait returns, returns 0) or parks the callback and
  // returns a non-zero id for Cancel. After Close, fails at once with the close status.
  WaitId Wait(Callback cb) EXCLUDES(mu_);
  // Removes a parked wait and runs its callback with `why`. False if it was already delivered.
  bool Cancel(WaitId id, const Status& why) EXCLUDES(mu_);

  // Fails the waits parked now with `why`; later waits park as usual (the cluster lost a shard).
  void FailWaiters(const Status& why) EXCLUDES(mu_);

  // Fails every parked and future wait with `why` (e.g. OutOfRange "training is over").
  void Close(Status why) EXCLUDES(mu_);

  int64_t size() const EXCLUDES(mu_);
  int64_t waiters() const EXCLUDES(mu_);
  bool closed() const EXCLUDES(mu_);

 private:
  struct NoKey {};
  // Hands tokens to parked waits, unlocks, then runs their callbacks.
  void DeliverLocked(MutexLock& lock) RELEASE(mu_);

  mutable Mutex mu_;
  std::deque<int64_t> tokens_ GUARDED_BY(mu_);
  ParkedWaits<NoKey> parked_ GUARDED_BY(mu_);
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_TOKEN_QUEUE_H_
