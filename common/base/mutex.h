// Mutex, MutexLock and CondVar: a mutex and a condition variable with clang's thread-safety
// annotations (base/thread_annotations.h), so `-Wthread-safety` can check the state they guard.
//
// Mutex is glibc's adaptive mutex (PTHREAD_MUTEX_ADAPTIVE_NP): a lock found taken is retried in a
// bounded, self-tuning spin (at most glibc.pthread.mutex_spin_count tries, 100 by default, fewer
// while the waits it sees stay short) before the thread sleeps in futex().
// psd's locks are held for short sections that two I/O threads often want at the same moment (the
// pushes of one step arrive together): std::mutex's default sleeps at once, and that sleep and its
// wake-up cost a futex() call each and two context switches, more than the wait it avoids.
// CondVar is a pthread condition variable on CLOCK_MONOTONIC (std::chrono::steady_clock's clock).
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

#include <pthread.h>

#include <cassert>
#include <cerrno>
#include <chrono>
#include <ctime>

#include "base/thread_annotations.h"

namespace psd {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() {
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
    pthread_mutex_init(&mu_, &attr);
    pthread_mutexattr_destroy(&attr);
  }
  ~Mutex() { pthread_mutex_destroy(&mu_); }
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { Check(pthread_mutex_lock(&mu_)); }
  void Unlock() RELEASE() { Check(pthread_mutex_unlock(&mu_)); }
  bool TryLock() TRY_ACQUIRE(true) { return pthread_mutex_trylock(&mu_) == 0; }
  // BasicLockable, for std::unique_lock where the lock's lifetime is not a scope (a vector of
  // locks); the analysis cannot follow those: say AssertHeld() where the guarded state is used.
  void lock() ACQUIRE() { Lock(); }
  void unlock() RELEASE() { Unlock(); }
  // Checks nothing at run time; tells the analysis the lock is held (taken where it cannot see).
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  // An adaptive mutex fails only when misused (e.g. EINVAL on a destroyed one): a debug build
  // stops there, as std::mutex's would throw.
  static void Check(int error) {
    assert(error == 0);
    (void)error;
  }
  pthread_mutex_t mu_;
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
  CondVar() {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);  // steady_clock's, for WaitUntil
    pthread_cond_init(&cv_, &attr);
    pthread_condattr_destroy(&attr);
  }
  ~CondVar() { pthread_cond_destroy(&cv_); }
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Releases `mu`, waits for a notification (or a spurious wakeup) and takes `mu` again.
  void Wait(Mutex* mu) REQUIRES(mu) { pthread_cond_wait(&cv_, &mu->mu_); }
  // As Wait, until `deadline` at the latest: false when it passed first.
  bool WaitUntil(Mutex* mu, std::chrono::steady_clock::time_point deadline) REQUIRES(mu) {
    static_assert(std::chrono::steady_clock::is_steady, "steady_clock is CLOCK_MONOTONIC");
    const auto since = deadline.time_since_epoch();
    const auto secs = std::chrono::duration_cast<std::chrono::seconds>(since);
    timespec at{};
    if (since.count() > 0) {
      at.tv_sec = static_cast<time_t>(secs.count());
      at.tv_nsec = static_cast<long>(std::chrono::duration_cast<std::chrono::nanoseconds>(since - secs).count());
    }
    return pthread_cond_timedwait(&cv_, &mu->mu_, &at) != ETIMEDOUT;
  }
  void NotifyOne() { pthread_cond_signal(&cv_); }
  void NotifyAll() { pthread_cond_broadcast(&cv_); }

 private:
  pthread_cond_t cv_;
};

}  // namespace psd

#endif  // PSD_COMMON_BASE_MUTEX_H_
