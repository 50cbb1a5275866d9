// TokenQueue: the SyncReplicasOptimizer token queue — an unbounded FIFO of global-step values
// that acts as the workers' barrier. A wait either takes a token at once or parks a callback
// (never a thread); the caller bounds every parked wait with a deadline by calling Cancel.
//
// A wait may say the local step of the push it follows: it then takes only a token released after
// that step (value > after), or an initial one or one put back, which any wait takes. So a fast
// worker whose next push went in before a slower worker's wait reached the queue cannot take the
// token of the step that slower worker's gradient completed (on a cluster, a worker's wait can reach
// the chief after its pushes completed the step on the other shards); the slower worker takes it
// when its wait comes, and the fast one waits for the next step's. TF's queue let the fast worker
// take it, and the next step then committed without the slow worker's gradient. (The service
// waits for any token where a step's tokens outnumber the workers, N < R: a worker then takes
// several of one step.)
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

  // A wait that follows no push of a known step: any token.
  static constexpr int64_t kAnyStep = -1;

  // Appends `count` tokens released at global step `value` and hands them to parked waiters in
  // FIFO order (each to the first waiter that may take it). Released tokens older than value - 1
  // still queued are dropped (their workers are gone: every live one takes a newer token).
  void Push(int64_t value, int count) EXCLUDES(mu_);
  // Initial tokens (TF get_init_tokens_op), carrying `value`: any wait takes them.
  void PushInit(int64_t value, int count) EXCLUDES(mu_);
  // Puts a token back at the head (a waiter died between delivery and reply): any wait takes it.
  void PushFront(int64_t value) EXCLUDES(mu_);

  // Takes a token now (callback runs before Wait returns, returns 0) or parks the callback and
  // returns a non-zero id for Cancel. After Close, fails at once with the close status. `after`:
  // the local step of the push this wait follows (takes a token released after it, or an initial
  // or returned one), or kAnyStep.
  WaitId Wait(Callback cb, int64_t after = kAnyStep) EXCLUDES(mu_);
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
  struct Token {
    int64_t value;
    bool any;  // an initial or returned token: any wait takes it
  };
  static bool Takes(int64_t after, const Token& t) { return t.any || after < 0 || t.value > after; }
  void PushLocked(int64_t value, int count, bool any) REQUIRES(mu_);
  // Hands tokens to parked waits, unlocks, then runs their callbacks.
  void DeliverLocked(MutexLock& lock) RELEASE(mu_);

  mutable Mutex mu_;
  std::deque<Token> tokens_ GUARDED_BY(mu_);
  ParkedWaits<int64_t> parked_ GUARDED_BY(mu_);  // keyed by the step a wait follows
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_TOKEN_QUEUE_H_
