#include "core/worker_registry.h"

#include <catch2/catch.hpp>

using psd::server::WorkerRegistry;

TEST_CASE("the first connected worker is chief, another takes over when it leaves", "[workers]") {
  WorkerRegistry r(2, 3);
  CHECK(*r.Hello(10, "a", 1) == 0);
  CHECK(*r.Hello(11, "b", 1) == 1);
  CHECK(*r.Hello(12, "c", 1) == 2);
  CHECK(r.IsChief(10));
  CHECK_FALSE(r.IsChief(11));
  r.Disconnected(10);
  CHECK(r.IsChief(11));
  CHECK_FALSE(r.IsChief(12));
  // "a" comes back with a new incarnation on a new connection: it keeps its index, and is chief
  // again since it said hello first.
  CHECK(*r.Hello(13, "a", 2) == 0);
  CHECK(r.IsChief(13));
  CHECK(r.Counts().connected == 3);
}

TEST_CASE("finishing workers shrink the requirement once backups are used up", "[workers]") {
  WorkerRegistry r(2, 3);  // one backup
  REQUIRE(r.Hello(1, "a", 1).ok());
  REQUIRE(r.Hello(2, "b", 1).ok());
  REQUIRE(r.Hello(3, "c", 1).ok());
  CHECK(r.RequiredReplicas() == 2);
  CHECK_FALSE(r.Finished(1));
  CHECK(r.RequiredReplicas() == 2);  // the backup covers it
  CHECK(r.IsChief(2));               // a finished worker is no longer chief
  CHECK_FALSE(r.Finished(2));
  CHECK(r.RequiredReplicas() == 1);
  CHECK(r.Finished(3));
  CHECK(r.AllFinished());
  CHECK(r.RequiredReplicas() == 1);  // never below one
}

TEST_CASE("the job is not over before all N workers have said hello", "[workers]") {
  WorkerRegistry r(1, 3);  // async-style: R=1, N=3
  REQUIRE(r.Hello(1, "a", 1).ok());
  REQUIRE(r.Hello(2, "b", 1).ok());
  CHECK_FALSE(r.Finished(1));
  CHECK_FALSE(r.Finished(2));  // "c" has not started yet: it must not find the job over
  CHECK_FALSE(r.AllFinished());
  CHECK_FALSE(r.AllGone());
  REQUIRE(r.Hello(3, "c", 1).ok());
  CHECK(r.Finished(3));
  CHECK(r.AllFinished());
}

TEST_CASE("a worker gone past its grace counts as gone until it says hello again", "[workers]") {
  WorkerRegistry r(2, 2);
  REQUIRE(r.Hello(1, "a", 1).ok());
  REQUIRE(r.Hello(2, "b", 1).ok());
  auto gone = r.Disconnected(2);
  REQUIRE(gone.has_value());
  CHECK(r.RequiredReplicas() == 2);  // not yet: it may come back
  auto name = r.MarkLostIfStillGone(gone->first, gone->second);
  REQUIRE(name.has_value());
  CHECK(*name == "b");
  CHECK(r.RequiredReplicas() == 1);
  CHECK(r.Counts().lost == 1);
  CHECK_FALSE(r.AllFinished());  // a lost worker alone does not end the job
  REQUIRE(r.Hello(3, "b", 2).ok());
  CHECK(r.RequiredReplicas() == 2);
  // A stale timer (the worker came back and left again since) marks nothing.
  auto again = r.Disconnected(3);
  CHECK_FALSE(r.MarkLostIfStillGone(gone->first, gone->second).has_value());
  CHECK(r.MarkLostIfStillGone(again->first, again->second).has_value());
  CHECK(r.Finished(1));  // a finished, b lost: the job is over
  // A finished worker that disconnects is not "lost".
  WorkerRegistry f(1, 1);
  REQUIRE(f.Hello(1, "a", 1).ok());
  f.Finished(1);
  CHECK_FALSE(f.Disconnected(1).has_value());
}

TEST_CASE("a worker beyond N is refused naming -N/-B, a reconnect or a lost worker's replacement is not", "[workers]") {
  WorkerRegistry r(2, 3);  // R=2, B=1: N=3
  REQUIRE(r.Hello(1, "w0", 1).ok());
  REQUIRE(r.Hello(2, "w1", 1).ok());
  REQUIRE(r.Hello(3, "w2", 1).ok());
  auto refused = r.Hello(4, "w3", 1);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == psd::Code::kResourceExhausted);
  CHECK_THAT(refused.status().message(), Catch::Contains("N=3 workers (-R 2 -B 1)") &&
                                             Catch::Contains("worker 'w3' is refused") &&
                                             Catch::Contains("raise --total-replicas/-B"));
  CHECK(r.Snapshot().size() == 3);
  // A known name always comes back, even on a new connection while its old one lingers.
  CHECK(*r.Hello(5, "w1", 2) == 1);
  // A finished worker keeps its slot.
  r.Finished(1);
  CHECK_FALSE(r.Hello(6, "w3", 1).ok());
  // A lost worker's slot goes to a replacement, which takes its index.
  auto gone = r.Disconnected(3);
  REQUIRE(gone.has_value());
  CHECK_FALSE(r.Hello(6, "w3", 1).ok());  // not yet lost: it may come back
  REQUIRE(r.MarkLostIfStillGone(gone->first, gone->second).has_value());
  bool took_slot = false;
  CHECK(*r.Hello(6, "w3", 1, nullptr, &took_slot) == 2);
  CHECK(took_slot);  // what was recorded of index 2 was w2's (the metrics start it over)
  took_slot = false;
  CHECK(*r.Hello(7, "w3", 2, nullptr, &took_slot) == 2);
  CHECK_FALSE(took_slot);  // its own slot
  CHECK(r.Names() == std::vector<std::string>{"w0", "w1", "w3"});
  CHECK(r.Counts().lost == 0);
  CHECK(r.RequiredReplicas() == 2);  // w0 finished, covered by the backup
}

TEST_CASE("the registry stays bounded by N however many distinct workers come and go", "[workers]") {
  WorkerRegistry r(2, 3);  // N=3
  // Three workers that finish, then a thousand short-lived ones that vanish and are replaced.
  for (uint64_t c = 1; c <= 2; ++c) REQUIRE(r.Hello(c, "steady-" + std::to_string(c), 1).ok());
  for (uint64_t c = 10; c < 1010; ++c) {
    auto index = r.Hello(c, "ephemeral-" + std::to_string(c), 1);
    REQUIRE(index.ok());
    auto gone = r.Disconnected(c);
    REQUIRE(gone.has_value());
    REQUIRE(r.MarkLostIfStillGone(gone->first, gone->second).has_value());
    REQUIRE(r.Snapshot().size() <= 3);
  }
  CHECK(r.Snapshot().size() == 3);
  CHECK(r.Counts().lost == 1);
}

TEST_CASE("a name whose connection is open is taken over by its own or a newer process only", "[workers]") {
  WorkerRegistry r(2, 2);
  uint64_t replaced = 0;
  REQUIRE(*r.Hello(10, "a", 5, &replaced) == 0);
  CHECK(replaced == 0);
  // An older process under the same name (two trainers sharing it): refused, not merged.
  auto older = r.Hello(11, "a", 4, &replaced);
  CHECK(older.status().code() == psd::Code::kFailedPrecondition);
  CHECK_THAT(older.status().message(), Catch::Contains("two trainers share this name"));
  CHECK(replaced == 0);
  CHECK(r.IndexOf(10) == 0);
  CHECK(r.IndexOf(11) == -1);
  // The same process reconnecting, or a newer one: takes the slot; the old connection is named to
  // be closed (two connections never count as one worker).
  REQUIRE(*r.Hello(12, "a", 5, &replaced) == 0);
  CHECK(replaced == 10);
  replaced = 0;
  REQUIRE(*r.Hello(13, "a", 6, &replaced) == 0);
  CHECK(replaced == 12);
  CHECK(r.IndexOf(13) == 0);
  CHECK_FALSE(r.Disconnected(12).has_value());  // the replaced connection's close changes nothing
  CHECK(r.Counts().connected == 1);
}

TEST_CASE("a finished worker's own process saying hello again stays finished", "[workers]") {
  WorkerRegistry r(2, 2);
  REQUIRE(r.Hello(1, "a", 7).ok());
  REQUIRE(r.Hello(2, "b", 7).ok());
  CHECK_FALSE(r.Finished(1));
  CHECK(r.RequiredReplicas() == 1);
  r.Disconnected(1);
  REQUIRE(r.Hello(3, "a", 7).ok());  // reconnects (to read values, say): still finished
  CHECK(r.RequiredReplicas() == 1);
  CHECK(r.IsChief(2));
  CHECK(r.IsFinished(0));            // the daemon does not put it back at the ssp gate either
  REQUIRE(r.Hello(4, "a", 8).ok());  // a new process of it joins again
  CHECK_FALSE(r.IsFinished(0));
  CHECK(r.RequiredReplicas() == 2);
  CHECK(r.IsChief(4));
}

TEST_CASE("with -R above -N the job is over once its N workers finished", "[workers]") {
  WorkerRegistry r(2, 1);  // each step takes two gradients from the one worker
  REQUIRE(r.Hello(1, "a", 1).ok());
  CHECK(r.Finished(1));
  CHECK(r.AllFinished());
}
