#include "core/ssp_gate.h"

#include <catch2/catch.hpp>

using namespace psd;
using psd::server::SspGate;

TEST_CASE("a worker more than the bound ahead of the slowest waits until it catches up", "[ssp]") {
  SspGate gate(1);
  gate.Join(0);
  gate.Join(1);
  int64_t released = -1;
  // Worker 0 advances to clock 1: within the bound of worker 1 (clock 0).
  CHECK(gate.Advance(0, [&](Status s, int64_t c) { released = s.ok() ? c : -2; }) == 0);
  CHECK(released == 1);
  // To clock 2: 2 - 0 > 1, so it parks.
  released = -1;
  auto id = gate.Advance(0, [&](Status s, int64_t c) { released = s.ok() ? c : -2; });
  CHECK(id != 0);
  CHECK(released == -1);
  // Worker 1 moves to 1: the gap is 1 again and worker 0 is released.
  int64_t other = -1;
  CHECK(gate.Advance(1, [&](Status, int64_t c) { other = c; }) == 0);
  CHECK(other == 1);
  CHECK(released == 2);
  CHECK(gate.MinClock() == 1);
}

TEST_CASE("a worker that leaves no longer holds the others back", "[ssp]") {
  SspGate gate(0);
  gate.Join(0);
  gate.Join(1);
  int64_t released = -1;
  auto id = gate.Advance(0, [&](Status s, int64_t c) { released = s.ok() ? c : -2; });
  CHECK(id != 0);
  gate.Leave(1);
  CHECK(released == 1);
  // Rejoining starts at the slowest live clock, not at zero.
  gate.Join(1);
  CHECK(gate.Clock(1) == 1);
}

TEST_CASE("a cancelled ssp wait gives its clock step back, close fails waits", "[ssp]") {
  SspGate gate(0);
  gate.Join(0);
  gate.Join(1);
  Status st;
  auto id = gate.Advance(0, [&](Status s, int64_t) { st = s; });
  REQUIRE(id != 0);
  CHECK(gate.Cancel(id, DeadlineExceeded("late")));
  CHECK(st.code() == Code::kDeadlineExceeded);
  CHECK(gate.Clock(0) == 0);
  gate.Close(OutOfRange("over"));
  gate.Advance(1, [&](Status s, int64_t) { st = s; });
  CHECK(st.code() == Code::kOutOfRange);
  Status unknown;
  SspGate other(1);
  other.Advance(9, [&](Status s, int64_t) { unknown = s; });
  CHECK(unknown.code() == Code::kFailedPrecondition);
}

TEST_CASE("failing the parked waits answers them now, gives their clock steps back, keeps the gate open", "[ssp]") {
  // A cluster that stops serving (a shard lost) answers the fast worker parked at the chief's gate
  // at once; its retried barrier call later counts as the same step.
  SspGate gate(0);
  gate.Join(0);
  gate.Join(1);
  Status failed;
  CHECK(gate.Advance(0, [&](Status s, int64_t) { failed = s; }) != 0);  // clock 1, the slowest at 0: parked
  CHECK(gate.Clock(0) == 1);
  gate.FailWaiters(Unavailable("the cluster lost a shard"));
  CHECK(failed.code() == Code::kUnavailable);
  CHECK(gate.Clock(0) == 0);  // the step was given back
  // The gate still works: the retry parks again and is released when the other worker moves.
  int64_t released = -1;
  CHECK(gate.Advance(0, [&](Status s, int64_t c) { released = s.ok() ? c : -2; }) != 0);
  CHECK(gate.Advance(1, [](Status, int64_t) {}) == 0);
  CHECK(released == 1);
}
