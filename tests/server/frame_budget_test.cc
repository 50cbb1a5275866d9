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
