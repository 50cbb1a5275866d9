// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with clang's thread-safety
// annotations (base/thread_annotations.h), so `-Wthread-safety` can check the state they guard.
// No behaviour of their own: each call is the std one.
//
//   Mutex mu_;
//   int count_ GUARDED_BY(mu_);
//   void AddLocked(int n) REQUIRES(mu_);
//   void Add(int n) EXCLUDES(mu_) { MutexLock lock(&mu_); AddLocked(n); }
//
// Waiting on a condition: hold the lock with MutexLock and loop over CondVar::Wait, so the
// analysis sees the condition read under the lock (a predicate lambda would be analysed as a
// function of its own, without the lock):
//
//   MutexLock lock(&mu_);
//   while (!ready_) cv_.Wait(&mu_);
//
// A *Locked function that unlocks before it returns (to run callbacks outside the lock) is
// annotated RELEASE(mu_) and takes the caller's MutexLock, unlocking it with lock.UnlockFor(&mu_).
//
// Thread-safety: Mutex and CondVar are as thread-safe as their std counterparts; a MutexLock
// belongs to one thread.
#ifndef PSD_COMMON_BASE_MUTEX_H_
#define PSD_COMMON_BASE_MUTEX_H_

#include <cassert>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "base/thread_annotations.h"

namespace psd {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  bool TryLock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // BasicLockable, for std::unique_lock where the lock's lifetime is not a scope (a vector of
  // locks); the analysis cannot follow those: say AssertHeld() where the guarded state is used.
  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  // Checks nothing at run time; tells the analysis the lock is held (taken where it cannot see).
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex from construction to destruction (or to Unlock).
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() {
    if (held_) mu_->Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  // Unlocks early (e.g. to run callbacks outside the lock); Lock takes it again.
  void Unlock() RELEASE() {
    held_ = false;
    mu_->Unlock();
  }
  void Lock() ACQUIRE() {
    mu_->Lock();
    held_ = true;
  }
  // For a function given this lock and annotated RELEASE(mu): unlocks `mu`, which must be the
  // lock's own Mutex. (The analysis does not follow a lock passed by reference; this names the
  // Mutex it releases so the callee and the caller are both checked.)
  void UnlockFor(Mutex* mu) RELEASE(mu) NO_THREAD_SAFETY_ANALYSIS {
    assert(mu == mu_);
    (void)mu;
    held_ = false;
    mu_->Unlock();
  }

 private:
  Mutex* const mu_;
  bool held_ = true;
};

// A condition variable for a Mutex the caller holds.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Releases `mu`, waits for a notification (or a spurious wakeup) and takes `mu` again.
  void Wait(Mutex* mu) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // still held: the caller's
  }
  // As Wait, until `deadline` at the latest: false when it passed first.
  bool WaitUntil(Mutex* mu, std::chrono::steady_clock::time_point deadline) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool notified = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();  // still held: the caller's
    return notified;
  }
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace psd

#endif  // PSD_COMMON_BASE_MUTEX_H_
