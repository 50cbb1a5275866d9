#include "core/token_queue.h"

#include <catch2/catch.hpp>
#include <vector>

using namespace psd;
using psd::server::TokenQueue;

TEST_CASE("tokens come out in FIFO order", "[tokens]") {
  TokenQueue q;
  q.Push(0, 2);
  q.Push(1, 1);
  std::vector<int64_t> got;
  for (int i = 0; i < 3; ++i) {
    CHECK(q.Wait([&](Status s, int64_t t) {
      REQUIRE(s.ok());
      got.push_back(t);
    }) == 0);
  }
  CHECK(got == std::vector<int64_t>{0, 0, 1});
  CHECK(q.size() == 0);
}

TEST_CASE("a wait parks until a token is pushed, in arrival order", "[tokens]") {
  TokenQueue q;
  std::vector<std::pair<int, int64_t>> got;
  auto id1 = q.Wait([&](Status s, int64_t t) { got.emplace_back(1, s.ok() ? t : -1); });
  auto id2 = q.Wait([&](Status s, int64_t t) { got.emplace_back(2, s.ok() ? t : -1); });
  CHECK(id1 != 0);
  CHECK(id2 != 0);
  CHECK(got.empty());
  CHECK(q.waiters() == 2);
  q.Push(7, 1);
  REQUIRE(got.size() == 1);
  CHECK(got[0] == std::make_pair(1, int64_t{7}));
  q.Push(8, 3);
  REQUIRE(got.size() == 2);
  CHECK(got[1] == std::make_pair(2, int64_t{8}));
  CHECK(q.size() == 2);  // leftovers persist
}

TEST_CASE("a cancelled wait loses nothing, cancelling a delivered wait is a no-op", "[tokens]") {
  TokenQueue q;
  Status seen;
  auto id = q.Wait([&](Status s, int64_t) { seen = s; });
  CHECK(q.Cancel(id, DeadlineExceeded("late")));
  CHECK(seen.code() == Code::kDeadlineExceeded);
  CHECK(q.waiters() == 0);
  q.Push(3, 1);
  CHECK(q.size() == 1);  // the token is still there for the next waiter
  CHECK_FALSE(q.Cancel(id, DeadlineExceeded("again")));
}

TEST_CASE("a token given back goes to the head", "[tokens]") {
  TokenQueue q;
  q.Push(5, 1);
  q.PushFront(4);
  int64_t first = -1;
  q.Wait([&](Status, int64_t t) { first = t; });
  CHECK(first == 4);
}

TEST_CASE("closing fails parked and future waits", "[tokens]") {
  TokenQueue q;
  Status parked;
  q.Wait([&](Status s, int64_t) { parked = s; });
  q.Close(OutOfRange("training is over"));
  CHECK(parked.code() == Code::kOutOfRange);
  Status later;
  q.Push(1, 1);
  CHECK(q.Wait([&](Status s, int64_t) { later = s; }) == 0);
  CHECK(later.code() == Code::kOutOfRange);
  CHECK(q.closed());
}
