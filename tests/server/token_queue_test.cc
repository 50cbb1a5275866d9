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

TEST_CASE("a wait after a push of step s takes a token released after s, an initial or a returned one any wait",
          "[tokens]") {
  // Step 455's three tokens. w1 and w2 (their pushes were of step 454) take two; w2 pushes again
  // (step 455) before w0's wait arrives: the third is w0's, not w2's, which waits for step 456's.
  TokenQueue q;
  q.Push(455, 3);
  std::vector<std::pair<std::string, int64_t>> got;
  auto take = [&](const std::string& who, int64_t after) {
    return q.Wait([&got, who](Status s, int64_t t) { got.emplace_back(who, s.ok() ? t : -1); }, after);
  };
  CHECK(take("w1", 454) == 0);
  CHECK(take("w2", 454) == 0);
  CHECK(take("w2 again", 455) != 0);  // parked: the token left is not for a push of step 455
  CHECK(take("w0", 454) == 0);        // a late wait takes its step's token, others parked or not
  q.Push(456, 3);
  CHECK(got == std::vector<std::pair<std::string, int64_t>>{{"w1", 455}, {"w2", 455}, {"w0", 455}, {"w2 again", 456}});
  CHECK(q.size() == 2);
  // A wait of no known step takes any token, the oldest first.
  CHECK(take("any", TokenQueue::kAnyStep) == 0);
  CHECK(got.back() == std::make_pair(std::string("any"), int64_t{456}));

  // Initial tokens (TF get_init_tokens_op) carry the step they were queued at: a worker's first
  // push is of that step, and takes one.
  TokenQueue init;
  init.PushInit(0, 1);
  int64_t first = -1;
  CHECK(init.Wait([&](Status, int64_t t) { first = t; }, 0) == 0);
  CHECK(first == 0);
  // A token given back (its waiter's push was refused) goes to any wait.
  init.PushFront(7);
  int64_t back = -1;
  CHECK(init.Wait([&](Status, int64_t t) { back = t; }, 9) == 0);
  CHECK(back == 7);
}

TEST_CASE("released tokens two steps old that no wait took are dropped", "[tokens]") {
  TokenQueue q;
  q.PushInit(0, 1);
  q.Push(10, 1);  // a gone worker's: nobody takes it
  q.Push(11, 1);
  CHECK(q.size() == 3);
  q.Push(12, 1);
  CHECK(q.size() == 3);  // 10 dropped; the initial token stays
  std::vector<int64_t> got;
  for (int i = 0; i < 3; ++i) q.Wait([&](Status, int64_t t) { got.push_back(t); }, 5);
  CHECK(got == std::vector<int64_t>{0, 11, 12});
}
