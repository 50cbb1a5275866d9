// The cluster protocol (server/cluster/coordinator.h) under simulated faults: many seeded
// schedules of crashes, partitions, broken links, delays and duplicates over 3 to 5 shards
// (tests/support/cluster_sim.h says what is checked). A failing seed prints its schedule; to
// replay one with every event and the coordinators' logs:
//   PSD_CLUSTER_SIM_SEED=1234 PSD_CLUSTER_SIM_SHARDS=4 build/tests/psd_cluster_sim_tests '[.replay]'
// (PSD_CLUSTER_SIM_STORM=1 for a seed of the "long storms" case; PSD_CLUSTER_SIM_REPLICATE=1 for
// replicated shards, with PSD_CLUSTER_SIM_SINGLE=1 for one crash at a time, and
// PSD_CLUSTER_SIM_TAKEOVER=1 for stand-ins on top, =short for the default schedule with them;
// PSD_CLUSTER_SIM_ASYNC=1 for async replicas, PSD_CLUSTER_SIM_NO_CRASH=1 for their "partitions and
// broken links" case.) A longer sweep:
// PSD_CLUSTER_SIM_RUNS=20000 (schedules per cluster size; default 1000; some cases run a half, a
// quarter or an eighth of that), and PSD_CLUSTER_SIM_FIRST=N to start each case's seeds N further
// on, past those an earlier sweep ran.
#include "support/cluster_sim.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

namespace {

using psd::sim::RunSimulation;
using psd::sim::SimOptions;
using psd::sim::SimResult;

// Schedules per cluster size: ~3 s in all in a Release build; bounded under sanitizers and
// without optimization.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PSD_SIM_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(PSD_SIM_SANITIZED)
constexpr int kSeedsPerSize = 80;
#elif !defined(NDEBUG)
constexpr int kSeedsPerSize = 200;
#else
constexpr int kSeedsPerSize = 1000;
#endif

// Schedules per cluster size for a sweep: PSD_CLUSTER_SIM_RUNS, or kSeedsPerSize.
int SweepRuns() {
  const char* runs = std::getenv("PSD_CLUSTER_SIM_RUNS");
  return runs != nullptr ? std::atoi(runs) : kSeedsPerSize;
}

// Where a sweep starts: PSD_CLUSTER_SIM_FIRST (default 0) moves it past the schedules an earlier
// sweep ran (a seed is shards * 100000 + the case's base + FIRST + i, i from 1).
uint64_t SweepFirst() {
  const char* first = std::getenv("PSD_CLUSTER_SIM_FIRST");
  return first != nullptr ? std::strtoull(first, nullptr, 10) : 0;
}

// The fault windows of the storm (Storm) and takeover (Takeover) schedules, which tell them apart.
constexpr int64_t kStormFaultMs = 20000;
constexpr int64_t kTakeoverFaultMs = 15000;

// The environment that makes the "replay one seed" case run `o` (the sweeps' option sets).
std::string ReplayEnv(const SimOptions& o) {
  std::string env =
      "PSD_CLUSTER_SIM_SEED=" + std::to_string(o.seed) + " PSD_CLUSTER_SIM_SHARDS=" + std::to_string(o.shards);
  if (o.fault_ms == kStormFaultMs) env += " PSD_CLUSTER_SIM_STORM=1";
  if (o.replicate) env += " PSD_CLUSTER_SIM_REPLICATE=1";
  if (o.takeover)
    env += o.fault_ms == kTakeoverFaultMs ? " PSD_CLUSTER_SIM_TAKEOVER=1" : " PSD_CLUSTER_SIM_TAKEOVER=short";
  if (o.async) env += " PSD_CLUSTER_SIM_ASYNC=1";
  if (o.single_faults) env += " PSD_CLUSTER_SIM_SINGLE=1";
  if (o.crash_rate == 0) env += " PSD_CLUSTER_SIM_NO_CRASH=1";
  if (o.lane_ms > 0) env += " PSD_CLUSTER_SIM_LANE_MS=" + std::to_string(o.lane_ms);
  if (o.copy_ms > 0) env += " PSD_CLUSTER_SIM_COPY_MS=" + std::to_string(o.copy_ms);
  return env;
}

// PSD_CLUSTER_SIM_COPY_MS (SimOptions::copy_ms), for every schedule a sweep or a replay runs.
// (The takeover sweeps' counts of formations served by a stand-in fall below their checks with
// slow copies: look for "FAILED at" — an invariant broken — in such a sweep's output.)
// Sync copies every part at every commit, a few pieces each: the job is given that long more to
// finish.
void SlowCopies(SimOptions* o) {
  const char* ms = std::getenv("PSD_CLUSTER_SIM_COPY_MS");
  if (ms == nullptr) return;
  o->copy_ms = std::atoll(ms);
  o->settle_ms += o->target_step * o->copy_ms * 8;
}

// Runs one schedule quietly; on a failure runs it again with the trace and fails with it.
SimResult Check(SimOptions o) {
  SlowCopies(&o);
  auto level = spdlog::get_level();
  spdlog::set_level(spdlog::level::off);
  SimResult r = RunSimulation(o);
  spdlog::set_level(level);
  if (r.ok) return r;
  o.trace = true;
  spdlog::set_level(spdlog::level::off);
  SimResult traced = RunSimulation(o);
  spdlog::set_level(level);
  FAIL(psd::sim::Describe(o, traced.ok ? r : traced)
       << "\nreplay: " << ReplayEnv(o) << " psd_cluster_sim_tests '[.replay]'");
  return r;
}

// Harsher: twice the fault rates for longer.
SimOptions Storm() {
  SimOptions o;
  o.fault_ms = kStormFaultMs;
  o.target_step = 60;
  o.crash_rate *= 2;
  o.partition_rate *= 2;
  o.break_rate *= 2;
  o.break_on_send *= 2;
  return o;
}

}  // namespace

TEST_CASE("cluster simulation: without faults one formation serves and the job finishes", "[cluster][sim]") {
  for (int shards = 3; shards <= 5; ++shards) {
    SimOptions o;
    o.shards = shards;
    o.seed = 7;
    o.crash_rate = o.partition_rate = o.break_rate = 0;
    o.break_on_send = o.duplicate = o.slow = 0;
    spdlog::set_level(spdlog::level::off);
    SimResult r = RunSimulation(o);
    spdlog::set_level(spdlog::level::err);
    INFO(psd::sim::Describe(o, r));
    REQUIRE(r.ok);
    CHECK(r.formations == 1);
    CHECK(r.commits == o.target_step);
    CHECK(r.end_ms < 10000);
  }
}

TEST_CASE("cluster simulation: thousands of fault schedules keep the invariants and finish the job", "[cluster][sim]") {
  int64_t runs = 0, formations = 0, commits = 0, events = 0, reseals = 0;
  const int per_size = SweepRuns();
  for (int shards = 3; shards <= 5; ++shards) {
    for (int i = 1; i <= per_size; ++i) {
      SimOptions o;
      o.shards = shards;
      o.seed = static_cast<uint64_t>(shards) * 100000 + SweepFirst() + static_cast<uint64_t>(i);
      SimResult r = Check(o);
      ++runs;
      formations += r.formations;
      commits += r.commits;
      events += r.events;
      reseals += r.reseals;
    }
  }
  // The faults bite: clusters re-form (more than one epoch per run on average) and still train;
  // some restarts fall between a shard's part and its seal, and a restore order carries the seal.
  INFO(runs << " runs, " << formations << " formations, " << commits << " steps, " << events << " events, " << reseals
            << " seals carried by restores");
  CHECK(formations > runs + runs / 2);
  CHECK(commits > 20 * runs);
  CHECK(reseals > 0);
}

TEST_CASE("cluster simulation: long storms of faults", "[cluster][sim]") {
  const int per_size = SweepRuns() / 4;
  for (int shards = 3; shards <= 5; ++shards) {
    for (int i = 1; i <= per_size; ++i) {
      SimOptions o = Storm();
      o.shards = shards;
      o.seed = static_cast<uint64_t>(shards) * 100000 + 50000 + SweepFirst() + static_cast<uint64_t>(i);
      Check(o);
    }
  }
}

// Takeover on: longer faults and a longer job, shards down for longer, so that a shard gone for
// --takeover-after-ms is taken over (and comes back) while the job runs.
static void Takeover(SimOptions* o) {
  o->takeover = true;
  o->fault_ms = kTakeoverFaultMs;
  o->target_step = 400;
  o->max_down_ms = 5000;
}

// One crash at a time (SimOptions::single_faults), drawn often (most draws are skipped).
static void SingleFaults(SimOptions* o) {
  o->single_faults = true;
  o->crash_rate = 1.0;
}

// Async: a push counts one step, so a job is some hundred pushes.
static void Async(SimOptions* o) {
  o->async = true;
  o->target_step = std::max<int64_t>(o->target_step, 300);
}

// The daemon's lane (SimOptions::lane_ms). Steps wait on its late batches: the job (400 steps
// with takeover, over five shards: up to 2.7 times as long) gets three times the time to finish
// once the faults stop.
static void Lane(SimOptions* o, int64_t ms) {
  o->lane_ms = ms;
  o->settle_ms *= 3;
}

// Replicated schedules (--replicas-per-shard 2) over 2 to 5 shards: each is checked (Check) and
// handed to `fn` with its index. `single`: one crash at a time (SimOptions::single_faults).
static void ReplicatedSweep(bool single, uint64_t seed_base,
                            const std::function<void(int, const SimOptions&, const SimResult&)>& fn,
                            bool takeover = false, bool async = false, bool crashes = true, int64_t lane_ms = 0) {
  // (Takeover schedules are longer: a quarter as many. Async ones are busier: half again.)
  const int per_size = SweepRuns() / (takeover ? 4 : 2) / (async ? 2 : 1);
  for (int shards = 2; shards <= 5; ++shards) {
    for (int i = 1; i <= per_size; ++i) {
      SimOptions o;
      o.shards = shards;
      o.replicate = true;
      o.takeover = takeover;
      if (takeover) Takeover(&o);
      if (async) Async(&o);
      if (!crashes) o.crash_rate = 0;
      if (single) SingleFaults(&o);
      if (lane_ms > 0) Lane(&o, lane_ms);
      o.seed = static_cast<uint64_t>(shards) * 100000 + seed_base + SweepFirst() + static_cast<uint64_t>(i);
      fn(i, o, Check(o));
    }
  }
}

// Replication (--replicas-per-shard 2): the same faults with every shard's committed state also
// on the next shard. All the invariants above hold, and every copy kept is bit-identical to what
// its owner published at that step.
TEST_CASE("cluster simulation: replicated shards under every fault", "[cluster][sim][replicas]") {
  int64_t runs = 0, live = 0, checked = 0, deltas = 0;
  ReplicatedSweep(false, 70000, [&](int, const SimOptions&, const SimResult& r) {
    ++runs;
    live += r.live_formations;
    checked += r.copies_checked;
    deltas += r.deltas;
  });
  INFO(runs << " runs, " << live << " formations from live copies, " << checked << " copies checked, " << deltas
            << " taken as differences");
  CHECK(live > runs / 2);
  CHECK(checked > 20 * runs);
  CHECK(deltas > 10 * runs);  // most copies go as a difference from the one acknowledged before
}

// One crash at a time (the next once the cluster has served again), with partitions, broken
// links, delays and duplicates around it: no formation goes back before a step whose tokens were
// released. Without replicas the same schedules do roll back (the check below shows the test bites).
TEST_CASE("cluster simulation: with replicas, losing one shard at a time loses no released step",
          "[cluster][sim][replicas]") {
  int64_t runs = 0, live = 0, rollbacks_without = 0;
  ReplicatedSweep(true, 80000, [&](int i, const SimOptions& o, const SimResult& r) {
    ++runs;
    live += r.live_formations;
    if (i > 20) return;
    SimOptions without = o;
    without.replicate = false;
    auto level = spdlog::get_level();
    spdlog::set_level(spdlog::level::off);
    rollbacks_without += RunSimulation(without).rollbacks;
    spdlog::set_level(level);
  });
  INFO(runs << " runs, " << live << " formations from live copies; " << rollbacks_without
            << " rollbacks in the first schedules without replicas");
  CHECK(live > runs / 2);
  CHECK(rollbacks_without > 0);
}

// Seeds that found bugs with replicas in sync (no stand-ins; one crash at a time).
TEST_CASE("cluster simulation: replica regression seeds", "[cluster][sim][replicas]") {
  // A new chief formed from live copies at step 4 on a shard's news from the last term: that shard,
  // its link from the new chief slow, had not heard its claim and then committed step 5 for the
  // last chief, which released it. A new chief whose own part is past its choice now waits
  // until every shard has spoken in its term (or three election timeouts).
  for (uint64_t seed : {983275}) {
    SimOptions o;
    o.shards = 3;
    o.seed = seed;
    o.replicate = true;
    SingleFaults(&o);
    Check(o);
  }
}

// Takeover (--takeover-after-ms): a shard gone for a while is served by a stand-in in the next
// shard's process, from the copy kept there, until its own process is back. Crashes (which kill a
// stand-in with its host), partitions and lost links around it: every invariant above holds, and
// one process serves each part in an epoch (never a shard's own process and its stand-in both).
TEST_CASE("cluster simulation: stand-ins under every fault", "[cluster][sim][replicas][takeover]") {
  int64_t runs = 0, stand_ins = 0, serves = 0, live = 0;
  ReplicatedSweep(
      false, 90000,
      [&](int, const SimOptions&, const SimResult& r) {
        ++runs;
        stand_ins += r.stand_ins;
        serves += r.stand_in_serves;
        live += r.live_formations;
      },
      /*takeover=*/true);
  INFO(runs << " runs, " << stand_ins << " stand-ins started, " << serves << " formations served with a stand-in, "
            << live << " from live copies");
  CHECK(stand_ins > runs / 2);
  CHECK(serves > runs / 10);
}

// One crash at a time with stand-ins: the one that serves a crashed shard, and the shard's own
// process taking its part back, lose no released step either.
TEST_CASE("cluster simulation: with stand-ins, losing one shard at a time loses no released step",
          "[cluster][sim][replicas][takeover]") {
  int64_t runs = 0, serves = 0;
  ReplicatedSweep(
      true, 95000,
      [&](int, const SimOptions&, const SimResult& r) {
        ++runs;
        serves += r.stand_in_serves;
      },
      /*takeover=*/true);
  INFO(runs << " runs, " << serves << " formations served with a stand-in");
  CHECK(serves > runs / 5);  // the scenario is exercised (schedules move with message sizes: a margin)
}

// Async replicas (--mode async --replicas-per-shard 2): pushes applied on arrival, each
// acknowledged once the next shard keeps a copy of the part holding it; formations restore each
// part's newest copy. Without and with stand-ins.
static void AsyncSweep(bool single, bool takeover, uint64_t seed_base, bool crashes = true) {
  int64_t runs = 0, acked = 0, lost = 0, serves = 0, deltas = 0;
  ReplicatedSweep(
      single, seed_base,
      [&](int, const SimOptions&, const SimResult& r) {
        ++runs;
        acked += r.pushes_acked;
        lost += r.acked_lost;
        serves += r.stand_in_serves;
        deltas += r.deltas;
      },
      takeover, /*async=*/true, crashes);
  INFO(runs << " runs, " << acked << " pushes acknowledged, " << lost
            << " of them lost by a formation (several faults at once), " << serves
            << " formations served with a stand-in, " << deltas << " copies taken as differences");
  CHECK(acked > runs * 100);
  CHECK(deltas > runs * 10);
  if (single || !crashes) CHECK(lost == 0);
  if (takeover) CHECK(serves > runs / 10);
}

TEST_CASE("cluster simulation: async replicas under every fault", "[cluster][sim][replicas][async]") {
  AsyncSweep(false, false, 50000);
}

TEST_CASE("cluster simulation: with async replicas, losing one shard at a time loses no acknowledged push",
          "[cluster][sim][replicas][async]") {
  AsyncSweep(true, false, 55000);
}

// No process loses its memory (partitions, broken links, lost and late messages): nothing
// acknowledged may be lost, however many faults at once.
TEST_CASE("cluster simulation: with async replicas, partitions and broken links lose no acknowledged push",
          "[cluster][sim][replicas][async]") {
  AsyncSweep(false, false, 57000, /*crashes=*/false);
  AsyncSweep(false, true, 47000, /*crashes=*/false);
}

TEST_CASE("cluster simulation: async stand-ins under every fault", "[cluster][sim][replicas][async][takeover]") {
  AsyncSweep(false, true, 40000);
}

TEST_CASE("cluster simulation: with async stand-ins, losing one shard at a time loses no acknowledged push",
          "[cluster][sim][replicas][async][takeover]") {
  AsyncSweep(true, true, 45000);
}

// The daemon runs a shard's actions on a lane of their own (ClusterCoordinator's `lane`): a commit
// applied and copied, or a copy rebuilt, comes up to 300 ms after it was decided, in order, while
// the shard's heartbeats and the messages it hears go on (and the next message of a link may be
// handled before the actions of the one before ran). Every mode keeps every invariant above.
TEST_CASE("cluster simulation: actions run late on the daemon's lane, in every mode", "[cluster][sim][lane]") {
  constexpr int64_t kLaneMs = 300;
  const int per_size = SweepRuns() / 4;
  int64_t runs = 0, commits = 0;
  for (int shards = 3; shards <= 5; ++shards) {
    for (int i = 1; i <= per_size; ++i) {
      SimOptions o;
      o.shards = shards;
      Lane(&o, kLaneMs);
      o.seed = static_cast<uint64_t>(shards) * 100000 + 30000 + SweepFirst() + static_cast<uint64_t>(i);
      SimResult r = Check(o);
      ++runs;
      commits += r.commits;
    }
  }
  CHECK(commits > 20 * runs);
  int64_t lost = 0, live = 0, serves = 0;
  auto tally = [&](int, const SimOptions&, const SimResult& r) {
    ++runs;
    live += r.live_formations;
    serves += r.stand_in_serves;
    lost += r.acked_lost;
  };
  runs = 0;
  ReplicatedSweep(true, 31000, tally, /*takeover=*/false, /*async=*/false, /*crashes=*/true, kLaneMs);
  CHECK(live > runs / 2);
  ReplicatedSweep(true, 32000, tally, /*takeover=*/true, /*async=*/false, /*crashes=*/true, kLaneMs);
  CHECK(serves > 0);
  ReplicatedSweep(true, 33000, tally, /*takeover=*/false, /*async=*/true, /*crashes=*/true, kLaneMs);
  ReplicatedSweep(false, 34000, tally, /*takeover=*/true, /*async=*/true, /*crashes=*/false, kLaneMs);
  INFO(runs << " replicated runs, " << live << " formations from live copies, " << serves << " served with a stand-in");
  CHECK(lost == 0);
  // Regression (a wider sweep's seed): an async order to snapshot for a checkpoint came twice, and
  // the shard wrote its part of that step again, at its count then, over the one the seal names.
  SimOptions twice;
  twice.shards = 2;
  twice.seed = 233561;
  twice.replicate = true;
  Async(&twice);
  SingleFaults(&twice);
  Lane(&twice, kLaneMs);
  Check(twice);
}

// Seeds that found bugs in the coordinator (README "Running a cluster" says which).
TEST_CASE("cluster simulation: regression seeds", "[cluster][sim]") {
  struct Seed {
    int shards;
    uint64_t seed;
    bool storm = false;
    int64_t fault_ms = 0;  // 0: the default
  };
  const Seed seeds[] = {
      {3, 300008},        // a follower lost its chief for a moment and dropped its vote: the step never committed
      {3, 300009},        // every shard restarted and a term (an epoch workers saw) was formed again
      {3, 300301},        // the same, with the term learnt from a heartbeat and not saved
      {3, 300051},        // a restarted shard offered a step the cluster had left: an operator was asked again
      {3, 300079},        // a re-formation just after a seal skipped the checkpoint every shard held
      {3, 305506},        // the same from a chief with old news of a shard (a slow link)
      {4, 400308},        // a duplicated restore order reset a shard that had moved on
      {3, 313428},        // old news of a shard made the chief ask an operator to give up a checkpoint all held
      {3, 300305},        // a shard that lost its checkpoint directory (and saved term) formed a term again
      {3, 350086, true},  // the same in a storm
      {3, 300002},        // a seal mixed parts of an older epoch's checkpoint of that step with new ones
      {3, 301157, false, 15000},  // a new checkpoint of a step waited for long ago was not waited for
      {3, 331019},                // a part written for an epoch the cluster had left was sent as the new epoch's
  };
  for (const Seed& s : seeds) {
    SimOptions o = s.storm ? Storm() : SimOptions();
    if (s.fault_ms > 0) o.fault_ms = s.fault_ms;
    o.shards = s.shards;
    o.seed = s.seed;
    Check(o);
  }
}

// Seeds that found bugs in takeover (replicated shards with stand-ins). `longer`: the sweeps'
// Takeover() schedules; else the default schedule with takeover on.
TEST_CASE("cluster simulation: takeover regression seeds", "[cluster][sim][takeover]") {
  struct Seed {
    int shards;
    uint64_t seed;
    bool single;  // one crash at a time
    bool longer;
    int64_t lane_ms = 0;
  };
  const Seed seeds[] = {
      // Each side of a partition stood in for the other and both served every part.
      {2, 295007, true, false},
      // A follower kept sending to a stopped stand-in's address, the shard's own process to one
      // of its own: each waited for the other.
      {2, 290026, false, false},
      // Formed from an empty state through a stand-in while a part's newest copies were on a
      // shard cut off.
      {3, 395023, true, false},
      // A stand-in's heartbeats (no copies) overwrote what the shard's own process said.
      {3, 395106, true, false},
      // After a move back, the chief formed on what the stand-in had said last.
      {3, 395207, true, false},
      // A restore order chosen on old news came late and undid the steps an epoch served
      // through a stand-in had released.
      {2, 296036, true, true},
      // A seal for parts a stand-in wrote reached the shard's own process after a move back.
      {2, 296847, true, true},
      // A new chief formed through a stand-in from copies older than a step released by the last
      // chief, whose newest copies were on a shard cut off.
      {3, 395766, true, true},
      // A shard's own process and its stand-in each sealed a checkpoint of one step (two
      // timelines); restored, the parts mixed.
      {2, 295335, false, true},
      // The chief released a step and was cut off before saying so; a new chief formed through a
      // stand-in from the copies of the step before (the shards that took the workers' gradients
      // for it now know its tokens went out).
      {3, 396614, true, true},
      // A shard's own process came back as chief with a checkpoint sealed before a formation at an
      // older step: the others held new parts of that step. Its restore order (with the seal) was
      // refused there only after it had replaced its live copies, and the next formation found
      // none of every part: an empty state.
      {3, 403672, true, true},
      // A chief sealed a checkpoint, a formation at an older step left it (unsealed there), and the
      // next chief's formation at the sealed step (its seal carried by the order) never reached
      // this shard. Chief again, it fell back to an older checkpoint, before a released step,
      // though every shard held the sealed one's part.
      {3, 395762, true, true},
      // A shard's restore of a live copy failed while its restore of the epoch before still ran on
      // its lane; the copy stayed marked as failed there after an epoch had run from it, so that
      // shard, chief again, found no live copy and started empty, before released steps.
      {2, 238912, true, true, 300},
      // A stand-in and the shard's own process each sealed a part of one step (two timelines);
      // the chief counted that checkpoint restorable everywhere, newer than the live copies, and
      // formed from it: two shards gave up their live copies, the third refused, and the next
      // chief started empty before released steps. Now heartbeats carry a digest of each sealed
      // step's manifest, and a step whose manifests differ counts as restorable nowhere.
      {3, 337431, true, true, 300},
      // A stand-in and the shard's own process, neither hearing the other, each formed epoch 6
      // (from steps 2 and 3); the other shard took the stand-in's order, then answered the own
      // process with that restore. Now a shard follows one process per term and addresses its
      // answers to it.
      {2, 732927, true, true, 300},
      // A chief moved a shard back from its stand-in (it stopped running its epoch, which had
      // released step 9) and then took a late order of a term formed on the other side of a
      // partition, at step 8: it dropped its copies of the released steps. Now a chief refuses
      // such an order whether or not its epoch still runs...
      {2, 1234307, true, true, 300},
      // ...by the steps it released, not the step it formed at: a chief whose formation at step 3
      // never ran refused an order at step 2 (the last released), and the cluster fell back.
      {2, 1233561, true, true, 300},
      // A follower took such an order too: its own copies as of its last tick did not show the
      // step released, the commit of it it had taken did (now counted).
      {3, 1334512, true, true, 300},
  };
  for (const Seed& s : seeds) {
    SimOptions o;
    o.shards = s.shards;
    o.seed = s.seed;
    o.replicate = true;
    if (s.longer) {
      Takeover(&o);
    } else {
      o.takeover = true;
    }
    if (s.single) SingleFaults(&o);
    if (s.lane_ms > 0) Lane(&o, s.lane_ms);
    Check(o);
  }
}

// Seeds that found bugs with async replicas (the sweeps' schedules, with stand-ins).
TEST_CASE("cluster simulation: async regression seeds", "[cluster][sim][async][takeover]") {
  struct Seed {
    int shards;
    uint64_t seed;
    bool single;   // one crash at a time
    bool crashes;  // false: partitions and broken links only
    int64_t lane_ms = 0;
    bool takeover = true;  // false: replicas without stand-ins
  };
  const Seed seeds[] = {
      // A chief cut off while a stand-in kept a part's newest copies formed through a stand-in
      // from older ones (it had not heard of the newer: now every heartbeat passes it on).
      {3, 345147, true, true},
      // The same when the stand-in that kept them was stopped before its heartbeat said so: only
      // the part's own shard knew its copy was kept (now it says so too).
      {3, 346557, true, true},
      // A stand-in stopped when its shard's own process came back, with the newest copies of the
      // part before it; the next formation restored that part from older ones.
      {4, 447077, false, false},
      // A stand-in kept a part's newest copies and was stopped before any heartbeat said so, its
      // part's own shard cut off: now its host takes what it knew was kept when it stops it.
      {3, 348766, false, false},
      // A shard cut off in an old epoch sent its copies (pushes applied on arrival) to the next
      // shard once the partition healed; kept there, though that shard was in the epoch that had
      // left it, they let it acknowledge pushes the next formation then served its part without.
      {3, 346263, true, true},
      // A stand-in ran on the next shard's host, which kept its copies; that host was cut off and
      // both went on acknowledging pushes, while the other side formed from the part's own older
      // copies: now a part a stand-in served last waits for its host's own process.
      {3, 335606, false, false, 300},
      // A shard kept its predecessor's copy of an epoch formed on the other side of a partition
      // (that formation never ran), then formed a lower-numbered epoch that served pushes: the
      // older copy's higher lineage made it look newest, and the next formation dropped those
      // pushes. Now a new epoch is numbered above every copy's lineage.
      {2, 253514, true, true},
      // Found while making a copy of an epoch that never served its part unrestorable
      // (RestorableLocked): a shard's own copy restored back from the next shard, older than own
      // copies passed over, was trimmed out by them as the host took it (now they are dropped)...
      {4, 445020, true, true},
      // ... and a next shard that had not heard that an epoch served (a stand-in served the part's
      // successor then) judged the fetcher's copy of it unrestorable and answered an older one
      // (now the fetcher's own copy is judged where it is).
      {2, 234035, false, false, 300},
      // Replicas without stand-ins. A shard kept its predecessor's copy of a new epoch, then took
      // that epoch's restore order (late, on the lane) and dropped it with the older timeline's
      // copies; the part's own shard had counted it kept, and its part had no copy left when the
      // next formation came (now an order drops only the copies of older lineages).
      {3, 425488, true, true, 0, false},
      {3, 387492, true, true, 300, false},
      // A new chief heard its peers' copies from heartbeats sent before they restored the last
      // epoch (slow links), found a part with none and fell back to a checkpoint, losing the pushes
      // acknowledged since (now it first waits until every shard has spoken in its term).
      {5, 618718, false, false, 0, false},
      // Two stand-ins left running after their shards came back: a follower took a stand-in's
      // heartbeats (an older term, speaking as its chief's shard) for its chief's, so it kept that
      // chief's map and sent to a dead stand-in; the shards each waited to hear the other and the
      // job never finished (now a chief is alive only while its own heartbeats of this term come).
      {3, 442398, true, true},
      // The cluster re-formed from live copies at counts below a sealed checkpoint; counting up
      // again, a shard wrote its part of that step over the sealed one and went on saying it held
      // the step sealed, so its chief asked an operator to give up a checkpoint no shard could
      // restore (now a part written over a sealed step unseals it).
      {3, 460576, false, true},
      // A shard restored its part for an epoch that a stand-in served another part in, and was cut
      // off before it heard the epoch serve; leading the next formation, it restored that part from
      // older copies than those kept on the stand-in's host (now a shard counts the parts served
      // from its restore on, so the formation waits for that host's own process).
      {3, 487769, false, false},
  };
  for (const Seed& s : seeds) {
    SimOptions o;
    o.shards = s.shards;
    o.seed = s.seed;
    o.replicate = true;
    if (s.takeover) Takeover(&o);
    Async(&o);
    if (!s.crashes) o.crash_rate = 0;
    if (s.single) SingleFaults(&o);
    if (s.lane_ms > 0) Lane(&o, s.lane_ms);
    Check(o);
  }
}

TEST_CASE("cluster simulation: replay one seed (PSD_CLUSTER_SIM_SEED, PSD_CLUSTER_SIM_SHARDS)", "[.replay]") {
  const char* seed = std::getenv("PSD_CLUSTER_SIM_SEED");
  if (seed == nullptr) FAIL("set PSD_CLUSTER_SIM_SEED (and PSD_CLUSTER_SIM_SHARDS, default 3)");
  const char* shards = std::getenv("PSD_CLUSTER_SIM_SHARDS");
  SimOptions o = std::getenv("PSD_CLUSTER_SIM_STORM") != nullptr ? Storm() : SimOptions();
  o.replicate = std::getenv("PSD_CLUSTER_SIM_REPLICATE") != nullptr;
  if (const char* t = std::getenv("PSD_CLUSTER_SIM_TAKEOVER"); o.replicate && t != nullptr) {
    if (std::string(t) == "short") {
      o.takeover = true;  // the default schedule with takeover on (a "takeover regression seed" not `longer`)
    } else {
      Takeover(&o);
    }
  }
  if (std::getenv("PSD_CLUSTER_SIM_SINGLE") != nullptr) SingleFaults(&o);
  if (o.replicate && std::getenv("PSD_CLUSTER_SIM_ASYNC") != nullptr) Async(&o);
  if (std::getenv("PSD_CLUSTER_SIM_NO_CRASH") != nullptr) o.crash_rate = 0;
  if (const char* lane = std::getenv("PSD_CLUSTER_SIM_LANE_MS"); lane != nullptr) Lane(&o, std::atoll(lane));
  SlowCopies(&o);
  o.seed = std::strtoull(seed, nullptr, 10);
  o.shards = shards == nullptr ? 3 : std::atoi(shards);
  o.trace = true;
  spdlog::set_level(spdlog::level::info);
  SimResult r = RunSimulation(o);
  std::printf("%s", psd::sim::Describe(o, r, SIZE_MAX).c_str());
  CHECK(r.ok);
}
