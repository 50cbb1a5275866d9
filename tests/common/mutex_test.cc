// Mutex and CondVar (common/base/mutex.h): an adaptive pthread mutex and a CLOCK_MONOTONIC
// condition variable. Mutual exclusion under contention, TryLock, and WaitUntil's answer on both
// sides of its deadline (including a deadline of time_point::max(), which must not read as past).
#include "base/mutex.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

using psd::CondVar;
using psd::Mutex;
using psd::MutexLock;
using Clock = std::chrono::steady_clock;

namespace {

struct Counter {
  Mutex mu;
  int64_t value GUARDED_BY(mu) = 0;
};

// A condition and its lock. The tests' notifiers take `mu` before they set it, and the waiter holds
// `mu` from before the notifier starts until it waits, so the wait is always entered first.
struct Flag {
  Mutex mu;
  CondVar cv;
  bool set GUARDED_BY(mu) = false;
};

}  // namespace

TEST_CASE("Mutex: increments from contending threads are never lost", "[mutex]") {
  Counter c;
  constexpr int kThreads = 4;
  constexpr int64_t kEach = 200'000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&c] {
      for (int64_t i = 0; i < kEach; ++i) {
        MutexLock lock(&c.mu);
        ++c.value;  // not atomic: only the lock keeps the threads apart
      }
    });
  }
  for (auto& t : threads) t.join();
  MutexLock lock(&c.mu);
  REQUIRE(c.value == kThreads * kEach);
}

// Whether another thread's TryLock takes `mu` (given back at once if it did).
static bool TakenByAnotherThread(Mutex* mu) {
  bool got = false;
  std::thread([mu, &got] {
    got = mu->TryLock();
    if (got) mu->Unlock();
  }).join();
  return got;
}

TEST_CASE("Mutex: TryLock fails while another thread holds it and succeeds once it is free", "[mutex]") {
  Mutex mu;
  mu.Lock();
  const bool got_while_held = TakenByAnotherThread(&mu);
  mu.Unlock();
  REQUIRE_FALSE(got_while_held);
  REQUIRE(TakenByAnotherThread(&mu));
}

TEST_CASE("CondVar: WaitUntil is false only once its deadline has passed", "[mutex]") {
  Mutex mu;
  CondVar cv;
  MutexLock lock(&mu);
  REQUIRE_FALSE(cv.WaitUntil(&mu, Clock::now() - std::chrono::seconds(1)));  // already past
  const auto deadline = Clock::now() + std::chrono::milliseconds(30);
  while (cv.WaitUntil(&mu, deadline)) {
    // a spurious wake-up: true, and the deadline may not have passed; wait again
  }
  REQUIRE(Clock::now() >= deadline);
}

TEST_CASE("CondVar: a notification ends Wait and WaitUntil, whatever the deadline", "[mutex]") {
  for (const Clock::time_point deadline : {Clock::now() + std::chrono::seconds(60), Clock::time_point::max()}) {
    Flag f;
    bool timed_out = false;
    MutexLock lock(&f.mu);
    std::thread notifier([&f] {
      MutexLock held(&f.mu);  // only once the waiter waits
      f.set = true;
      f.cv.NotifyAll();
    });
    while (!f.set) {
      if (!f.cv.WaitUntil(&f.mu, deadline)) {
        timed_out = true;
        break;
      }
    }
    lock.Unlock();
    notifier.join();
    REQUIRE_FALSE(timed_out);
  }
  Flag f;
  MutexLock lock(&f.mu);
  std::thread notifier([&f] {
    MutexLock held(&f.mu);
    f.set = true;
    f.cv.NotifyOne();
  });
  while (!f.set) f.cv.Wait(&f.mu);
  lock.Unlock();
  notifier.join();
}
