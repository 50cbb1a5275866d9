// Compiled (never run) by annotations_test.sh with clang -Wthread-safety: clean as it is, and each
// PSD_VIOLATION variant must be refused. It proves the annotations of base/mutex.h are seen by the
// analysis (a build where they silently expanded to nothing would pass every other check).
#include "base/mutex.h"

namespace {

class Counter {
 public:
  void Add(int n) EXCLUDES(mu_) {
    psd::MutexLock lock(&mu_);
    AddLocked(n);
  }
  int Wait() EXCLUDES(mu_) {
    psd::MutexLock lock(&mu_);
    while (count_ == 0) cv_.Wait(&mu_);
    return count_;
  }
  // Unlocks before it returns (the TokenQueue::DeliverLocked pattern).
  int TakeLocked(psd::MutexLock& lock) RELEASE(mu_) {
    int n = count_;
    lock.UnlockFor(&mu_);
    return n;
  }
  int Take() EXCLUDES(mu_) {
    psd::MutexLock lock(&mu_);
    return TakeLocked(lock);
  }

#if PSD_VIOLATION == 1
  int Racy() { return count_; }  // reads guarded state without the lock
#elif PSD_VIOLATION == 2
  void Racy() { AddLocked(1); }  // calls a REQUIRES function without the lock
#elif PSD_VIOLATION == 3
  int Racy() {
    psd::MutexLock lock(&mu_);
    TakeLocked(lock);
    return count_;  // the callee released the lock
  }
#endif

 private:
  void AddLocked(int n) REQUIRES(mu_) {
    count_ += n;
    cv_.NotifyAll();
  }

  psd::Mutex mu_;
  psd::CondVar cv_;
  int count_ GUARDED_BY(mu_) = 0;
};

}  // namespace

int main() {
  Counter c;
  c.Add(1);
  return c.Wait() + c.Take() == 2 ? 0 : 1;
}
