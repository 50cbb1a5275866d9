// FrameBudget: the daemon-wide bound on memory for incoming frames.
#include "net/frame_budget.h"

#include <catch2/catch.hpp>
#include <vector>

using psd::server::FrameBudget;

TEST_CASE("the frame budget grants what fits at once and never holds more than its limit", "[frame_budget]") {
  FrameBudget b(100);
  std::vector<int> granted;
  b.Acquire(60, [&] { granted.push_back(1); });
  b.Acquire(40, [&] { granted.push_back(2); });
  CHECK(granted == std::vector<int>{1, 2});
  CHECK(b.in_use() == 100);
  b.Acquire(1, [&] { granted.push_back(3); });  // full: waits
  CHECK(granted.size() == 2);
  CHECK(b.waiting() == 1);
  CHECK(b.waits() == 1);
  b.Release(40);
  CHECK(granted == std::vector<int>{1, 2, 3});
  CHECK(b.in_use() == 61);
  CHECK(b.peak() == 100);
  b.Release(60);
  b.Release(1);
  CHECK(b.in_use() == 0);
  CHECK(b.waiting() == 0);
}

TEST_CASE("the frame budget serves waiters first come, first served: a big frame is not starved", "[frame_budget]") {
  FrameBudget b(100);
  std::vector<int> granted;
  b.Acquire(50, [&] { granted.push_back(0); });
  b.Acquire(80, [&] { granted.push_back(1); });  // does not fit: waits
  b.Acquire(10, [&] { granted.push_back(2); });  // would fit, but the big one is ahead
  CHECK(granted == std::vector<int>{0});
  CHECK(b.waiting() == 2);
  b.Release(50);  // now 80 fits, then 10 (90 <= 100)
  CHECK(granted == std::vector<int>{0, 1, 2});
  CHECK(b.in_use() == 90);
  CHECK(b.peak() == 90);
}

TEST_CASE("a grant may release and acquire again from its callback", "[frame_budget]") {
  FrameBudget b(10);
  int grants = 0;
  b.Acquire(10, [&] { ++grants; });
  b.Acquire(10, [&] {
    ++grants;
    b.Release(10);  // a closed connection gives its share straight back
  });
  b.Acquire(10, [&] { ++grants; });
  b.Release(10);
  CHECK(grants == 3);
  CHECK(b.in_use() == 10);
  CHECK(b.peak() == 10);
}

TEST_CASE("idle holders are asked for their bytes back when someone has to wait", "[frame_budget]") {
  FrameBudget b(100);
  int reclaimed = 0;
  b.Acquire(60, [] {});
  // The holder keeps its 60 for its next frame, offered back.
  REQUIRE(b.OfferIdle(1, [&] {
    ++reclaimed;
    b.Release(60);
  }));
  bool granted = false;
  b.Acquire(30, [&] { granted = true; });  // fits: nobody is asked
  CHECK(granted);
  CHECK(reclaimed == 0);
  granted = false;
  b.Acquire(50, [&] { granted = true; });  // 60 + 30 + 50 > 100: waits, and the idle 60 come back
  CHECK(reclaimed == 1);
  CHECK(granted);
  CHECK(b.in_use() == 80);
  // While someone waits, nothing is offered: the caller releases at once.
  b.Acquire(50, [] {});
  CHECK(b.waiting() == 1);
  CHECK_FALSE(b.OfferIdle(2, [&] { ++reclaimed; }));
  // A withdrawn offer is not called.
  b.Release(80);  // grants the waiter: 50 in use
  REQUIRE(b.OfferIdle(3, [&] { ++reclaimed; }));
  b.Withdraw(3);
  b.Acquire(60, [] {});
  CHECK(reclaimed == 1);
}

TEST_CASE("a frame bigger than the whole budget is granted alone, in its turn", "[frame_budget]") {
  FrameBudget b(100);
  std::vector<int> granted;
  b.Acquire(30, [&] { granted.push_back(0); });
  b.Acquire(250, [&] { granted.push_back(1); });  // more than the budget: waits until nothing is held
  b.Acquire(10, [&] { granted.push_back(2); });   // behind it, though it would fit
  CHECK(granted == std::vector<int>{0});
  b.Release(30);
  CHECK(granted == std::vector<int>{0, 1});  // alone
  CHECK(b.in_use() == 250);
  CHECK(b.peak() == 250);
  b.Release(250);
  CHECK(granted == std::vector<int>{0, 1, 2});
  b.Release(10);
  // With nothing held and nobody waiting, it is granted at once.
  b.Acquire(1000, [&] { granted.push_back(3); });
  CHECK(granted.back() == 3);
  b.Release(1000);
  CHECK(b.in_use() == 0);
}
