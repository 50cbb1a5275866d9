// One ClusterCoordinator (server/cluster/coordinator.h) driven by hand: a manual clock, a host
// that records what it is asked, a network that records what is sent. For orders of events the
// fault simulation (cluster_sim_test.cc) may not hit, such as a stand-in's start: the stand-in
// hears of the chief from the next shard's heartbeat before the chief links to it (the chief only
// does once it has heard the stand-in), and the chief's restore order comes right behind its
// link. (Found by the integration test "takeover with soft sync", under load: the stand-in
// counted the chief gone at its first tick, dropped the restore order, and the formation waited.)
#include "cluster/coordinator.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <variant>
#include <vector>

using namespace psd;
using namespace psd::server;

namespace {

using Clock = ClusterCoordinator::Clock;

class RecordingHost : public ShardHost {
 public:
  Status CommitStep(uint64_t, int64_t, bool, double) override { return Status::Ok(); }
  double learning_rate() override { return 0.1; }
  void PushTokens(int64_t) override {}
  void StartServing(int) override {}
  void SetRequired(int) override {}
  void FailWaiters(const Status&) override {}
  void ReportIfIdle() override {}
  void ForceStep(uint64_t, int64_t) override {}
  int64_t global_step() override { return 0; }
  void RestoreAsync(uint64_t epoch, int64_t, const std::vector<peer::PartInfo>&, RestoreDone) override {
    restores.push_back(epoch);
  }
  CheckpointScan ScanCheckpoints() override { return scan; }
  Status SealCheckpoint(int64_t, const std::vector<peer::PartInfo>&) override { return Status::Ok(); }
  Status SnapshotAs(uint64_t, int64_t) override { return Status::Ok(); }
  bool CheckpointWriterBusy() override { return false; }
  uint64_t LoadTerm() override { return 0; }
  void SaveTerm(uint64_t) override {}
  void LiveCopies(std::vector<peer::LiveCopy>* own, std::vector<peer::LiveCopy>* held) override {
    *own = own_copies;
    *held = held_copies;
  }
  std::shared_ptr<const peer::CopyBytes> KeepCopy(uint64_t, const peer::LiveCopy&,
                                                  std::optional<peer::LiveCopy>) override {
    return nullptr;
  }
  std::shared_ptr<const peer::CopyBytes> SerializedCopy(int, const peer::LiveCopy&) override { return nullptr; }
  Status TakeCopy(int, const peer::LiveCopy&, std::shared_ptr<const std::string>) override { return Status::Ok(); }
  void DropCopies(std::optional<peer::LiveCopy>, uint64_t) override {}
  void RestoreCopyAsync(uint64_t epoch, const peer::LiveCopy& copy, RestoreDone done) override {
    restores.push_back(epoch);
    restored_copies.push_back(copy);
    restore_done = std::move(done);
  }
  bool EndTraining(int64_t) override { return false; }
  void FinishJob() override {}
  void EndJobIfDone() override {}

  std::vector<uint64_t> restores;  // epochs a restore was started for
  CheckpointScan scan;             // what ScanCheckpoints finds (the coordinator reads it at Start)
  // The live copies it keeps (newest first, as a host lists them), those it was asked to restore,
  // and the last live restore's callback (the test answers it).
  std::vector<peer::LiveCopy> own_copies, held_copies, restored_copies;
  RestoreDone restore_done;
};

class RecordingNetwork : public PeerNetwork {
 public:
  void Send(int shard, const peer::Message& m) override { sent.push_back({shard, m}); }
  // With hold_streams, a stream's messages are sent only at Drain (a link still busy with them).
  void SendStream(int shard, MessageStream next) override {
    if (!hold_streams) return PeerNetwork::SendStream(shard, std::move(next));
    held.push_back({shard, std::move(next)});
  }
  void Drain() {
    for (auto& [shard, next] : held) PeerNetwork::SendStream(shard, std::move(next));
    streams_drained += held.size();
    held.clear();
  }
  bool hold_streams = false;
  std::vector<std::pair<int, MessageStream>> held;
  size_t streams_drained = 0;
  // A link moved: the shard, its new address, and how many messages were sent before.
  void Retarget(int shard, const std::string& address) override { retargets.push_back({shard, address, sent.size()}); }
  struct Moved {
    int shard;
    std::string address;
    size_t after;
  };
  std::vector<Moved> retargets;
  // The live copy fetches sent to `shard` for `epoch`.
  int Fetches(int shard, uint64_t epoch) const {
    int n = 0;
    for (const auto& [to, m] : sent) {
      const auto* f = std::get_if<peer::ReplicaFetch>(&m.body);
      if (to == shard && f != nullptr && f->epoch == epoch) ++n;
    }
    return n;
  }
  std::vector<std::pair<int, peer::Message>> sent;
};

// A stand-in for shard `me` of 3 with replicas (it starts none itself), on a manual clock.
struct StandIn {
  explicit StandIn(int me) {
    options.me = me;
    options.addresses = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
    options.heartbeat_ms = 20;
    options.election_timeout_ms = 200;
    options.replicate = true;
    options.stand_in = true;
    coordinator = std::make_unique<ClusterCoordinator>(options, host, network, [this] { return now; });
    coordinator->Start();
  }
  // A heartbeat from `from` (linked) saying shard 0 is the chief of term 3, serving epoch 2.
  void HearsayOfChief0(int from) {
    peer::Heartbeat hb;
    hb.chief = 0;
    hb.epoch = 2;
    hb.ready = true;
    hb.address = options.addresses[static_cast<size_t>(from)];
    coordinator->OnMessage(from, peer::Message{from, 3, hb});
  }
  // The chief links and orders the restore of epoch 3 from the live copies of step 5.
  void ChiefRestores() {
    coordinator->OnPeerUp(0);
    peer::Restore r;
    r.epoch = 3;
    r.step = 5;
    r.live = true;
    r.lineage = 2;
    coordinator->OnMessage(0, peer::Message{0, 3, r});
  }

  ClusterOptions options;
  Clock::time_point now = Clock::time_point{} + std::chrono::hours(1);
  RecordingHost host;
  RecordingNetwork network;
  std::unique_ptr<ClusterCoordinator> coordinator;
};

}  // namespace

// What a restore order drops (ShardHost::DropCopies): the copies newer than the one restored (all,
// for a checkpoint) of lineages before the order's epoch, never a copy of that epoch or a later
// one, which the predecessor may have sent (and this shard acknowledged) before the order came.
TEST_CASE("coordinator: a restore order drops only the copies of the timelines it leaves", "[cluster][replicas]") {
  using peer::LiveCopy;
  auto left = [](std::optional<LiveCopy> newest, uint64_t epoch) {
    std::map<LiveCopy, int> copies{{{2, 0}, 0}, {{2, 1}, 0}, {{3, 7}, 0}, {{4, 0}, 0}, {{5, 3}, 0}};
    auto [first, last] = LeftCopies(copies, newest, epoch);
    copies.erase(first, last);
    std::vector<LiveCopy> kept;
    for (const auto& [c, v] : copies) kept.push_back(c);
    return kept;
  };
  // A checkpoint (or an empty start) for epoch 4: the older lineages go, epoch 4's and 5's stay.
  CHECK(left(std::nullopt, 4) == std::vector<LiveCopy>{{4, 0}, {5, 3}});
  // Epoch 4 restores the live copy (2, 0): (2, 1) and (3, 7) are of the timeline it leaves.
  CHECK(left(LiveCopy{2, 0}, 4) == std::vector<LiveCopy>{{2, 0}, {4, 0}, {5, 3}});
  // The newest copy restored is (3, 7): nothing newer of an older lineage.
  CHECK(left(LiveCopy{3, 7}, 4) == std::vector<LiveCopy>{{2, 0}, {2, 1}, {3, 7}, {4, 0}, {5, 3}});
  // An order of an epoch older than the copies' (a stale one): nothing of theirs goes.
  CHECK(left(std::nullopt, 2).size() == 5);
  CHECK(left(LiveCopy{4, 0}, 4).size() == 5);
}

TEST_CASE("coordinator: a chief heard of from another shard has an election timeout to link", "[cluster]") {
  StandIn s(1);
  s.coordinator->OnPeerUp(2);
  s.HearsayOfChief0(2);
  REQUIRE(s.coordinator->chief() == 0);
  // The stand-in's first ticks, before the chief's link: the chief is not counted gone.
  for (int i = 0; i < 5; ++i) {
    s.now += std::chrono::milliseconds(20);
    s.coordinator->Tick();
    REQUIRE(s.coordinator->chief() == 0);
    s.HearsayOfChief0(2);
  }
  // The chief's link comes, its restore order right behind it: acted on (the stand-in fetches
  // its part's copy from the next shard, which keeps it).
  s.ChiefRestores();
  CHECK(s.network.Fetches(2, 3) == 1);
  CHECK(s.coordinator->Serving().message().find("restoring the live copies of step 5") != std::string::npos);

  // A chief that never links is counted gone once an election timeout has passed since this shard
  // heard of it (here this shard, the lowest live one then, claims the next term at once).
  StandIn t(1);
  t.coordinator->OnPeerUp(2);
  t.HearsayOfChief0(2);
  t.now += std::chrono::milliseconds(199);
  t.coordinator->Tick();
  CHECK(t.coordinator->chief() == 0);
  t.now += std::chrono::milliseconds(2);
  t.HearsayOfChief0(2);
  t.coordinator->Tick();
  CHECK(t.coordinator->chief() == 1);
  CHECK(t.coordinator->Describe().term == 4);
}

TEST_CASE("coordinator: the chief's restore order is kept after the chief was counted gone in its term", "[cluster]") {
  // Shard 2 (shard 1 is live and lower: this shard does not claim) counts the chief of term 3 gone,
  // then the chief's link and its restore order come: the order is the chief's claim of term 3
  // (as its heartbeat would be), not a message from an unknown shard to drop.
  StandIn s(2);
  s.coordinator->OnPeerUp(1);
  s.HearsayOfChief0(1);
  s.now += std::chrono::milliseconds(150);
  s.HearsayOfChief0(1);  // shard 1 stays live
  s.now += std::chrono::milliseconds(60);
  s.coordinator->Tick();
  REQUIRE(s.coordinator->chief() == -1);
  s.ChiefRestores();
  CHECK(s.coordinator->chief() == 0);
  CHECK(s.network.Fetches(0, 3) == 1);  // shard 2's successor is shard 0
}

namespace {

// Shard `me` of `shards` with replicas and takeover (its own process, or a stand-in for it), on a
// manual clock: the chief once an election timeout has passed with no lower shard heard.
struct Shard {
  Shard(int me, int shards, bool stand_in = false) {
    options.me = me;
    for (int i = 0; i < shards; ++i) options.addresses.push_back("127.0.0.1:" + std::to_string(i + 1));
    options.heartbeat_ms = 20;
    options.election_timeout_ms = 200;
    options.replicate = true;
    options.stand_in = stand_in;
    if (!stand_in) options.takeover_after = std::chrono::milliseconds(100);
    coordinator = std::make_unique<ClusterCoordinator>(options, host, network, [this] { return now; });
    if (stand_in) coordinator->SetAddress(StandInAddress(me));
    coordinator->Start();
  }
  static std::string StandInAddress(int shard) { return "127.0.0.1:90" + std::to_string(shard); }
  // A heartbeat from shard `from`'s own process (`stand_in` false) or from a stand-in for it.
  void Hears(int from, bool stand_in) {
    peer::Heartbeat hb;
    hb.chief = coordinator->chief();
    hb.ready = true;
    hb.stand_in = stand_in;
    hb.address = stand_in ? StandInAddress(from) : options.addresses[static_cast<size_t>(from)];
    coordinator->OnMessage(from, peer::Message{from, coordinator->Describe().term, hb});
  }
  void Tick() {
    now += std::chrono::milliseconds(20);
    coordinator->Tick();
  }

  ClusterOptions options;
  Clock::time_point now = Clock::time_point{} + std::chrono::hours(1);
  RecordingHost host;
  RecordingNetwork network;
  std::unique_ptr<ClusterCoordinator> coordinator;
};

// The chief of one side of a partition of `shards`: shard `me` (a stand-in for it if
// `me_stand_in`), hearing the own processes of the shards in `own`, nothing from those in
// `silent`, and a stand-in for every other one, for 30 heartbeats. Where it serves each shard
// then, and what it says.
struct Side {
  std::vector<std::string> served;
  std::string state;
};
Side ChiefOfSide(int me, bool me_stand_in, int shards, const std::vector<int>& own,
                 const std::vector<int>& silent = {}) {
  auto in = [](const std::vector<int>& v, int i) { return std::find(v.begin(), v.end(), i) != v.end(); };
  Shard s(me, shards, me_stand_in);
  for (int i = 0; i < shards; ++i) {
    if (i != me && !in(silent, i)) s.coordinator->OnPeerUp(i);
  }
  for (int t = 0; t < 30; ++t) {
    for (int i = 0; i < shards; ++i) {
      if (i != me && !in(silent, i)) s.Hears(i, /*stand_in=*/!in(own, i));
    }
    s.Tick();
  }
  REQUIRE(s.coordinator->is_chief());
  return {s.coordinator->Addresses(), s.coordinator->Describe().state};
}

const char kNoMajority[] = "hears the own processes of no majority";

}  // namespace

TEST_CASE("coordinator: a part is served by a stand-in only on the side of a partition with a majority",
          "[cluster][takeover]") {
  // Two shards cut apart, a stand-in for the other started on each side. Shard 0's side (half the
  // shards, shard 0's among them) serves shard 1 through its stand-in; on shard 1's side the
  // stand-in for shard 0 (the chief there: the lowest index) serves nothing. Without the rule
  // both sides would serve every part, and the steps of one timeline be lost when they meet.
  Side zero = ChiefOfSide(0, false, 2, {});
  CHECK(zero.served[1] == Shard::StandInAddress(1));
  CHECK(zero.state.find(kNoMajority) == std::string::npos);
  Side one = ChiefOfSide(0, true, 2, {1});
  CHECK(one.state.find(kNoMajority) != std::string::npos);
  // Four shards split {0, 2} | {1, 3}: the same.
  Side left = ChiefOfSide(0, false, 4, {2});
  CHECK(left.served[1] == Shard::StandInAddress(1));
  CHECK(left.served[3] == Shard::StandInAddress(3));
  Side right = ChiefOfSide(0, true, 4, {1, 3});
  CHECK(right.served[2] == "127.0.0.1:3");
  CHECK(right.state.find(kNoMajority) != std::string::npos);
  // Three shards, shard 0 cut off: shards 1 and 2 serve its part through a stand-in (the chief
  // there); shard 0 alone does not serve shard 2 through the stand-in it runs for it.
  Side pair = ChiefOfSide(0, true, 3, {1, 2});
  CHECK(pair.state.find(kNoMajority) == std::string::npos);
  Side alone = ChiefOfSide(0, false, 3, {}, {1});
  CHECK(alone.served[2] == "127.0.0.1:3");
}

TEST_CASE("coordinator: a shard whose stand-in is gone is looked for at its own address again", "[cluster][takeover]") {
  // The chief (shard 0 of 3) moves shard 1 to the stand-in it hears; the stand-in then falls
  // silent (its host stopped it, or died): shard 1 is looked for at its --cluster entry again, not
  // at the dead stand-in's address forever.
  Shard s(0, 3);
  s.coordinator->OnPeerUp(1);
  s.coordinator->OnPeerUp(2);
  for (int t = 0; t < 15; ++t) {
    s.Hears(1, /*stand_in=*/true);
    s.Hears(2, /*stand_in=*/false);
    s.Tick();
  }
  REQUIRE(s.coordinator->Addresses()[1] == Shard::StandInAddress(1));
  for (int t = 0; t < 15; ++t) {
    s.Hears(2, /*stand_in=*/false);
    s.Tick();
  }
  CHECK(s.coordinator->Addresses()[1] == "127.0.0.1:2");
}

namespace {

// The checkpoint restore order the chief (shard 0 of `shards`, whose disk `scan` finds) sends
// shard 1 once the others have said, for 100 heartbeats, what `says` fills in. `started`: what
// happens to the chief after its scan, before any heartbeat.
std::optional<peer::Restore> ChiefOrderTo1(int shards, const ShardHost::CheckpointScan& scan,
                                           const std::function<void(int from, peer::Heartbeat*)>& says,
                                           const std::function<void(ClusterCoordinator&)>& started = {}) {
  ClusterOptions options;
  options.me = 0;
  for (int i = 0; i < shards; ++i) options.addresses.push_back("127.0.0.1:" + std::to_string(i + 1));
  options.heartbeat_ms = 20;
  options.election_timeout_ms = 200;
  options.checkpoint_dir = "(scanned by the test's host)";
  RecordingHost host;
  host.scan = scan;
  RecordingNetwork network;
  Clock::time_point now = Clock::time_point{} + std::chrono::hours(1);
  ClusterCoordinator c(options, host, network, [&now] { return now; });
  c.Start();
  if (started) started(c);
  for (int from = 1; from < shards; ++from) c.OnPeerUp(from);
  for (int t = 0; t < 100; ++t) {
    for (int from = 1; from < shards; ++from) {
      peer::Heartbeat hb;
      hb.chief = c.chief();
      hb.ready = true;
      hb.address = options.addresses[static_cast<size_t>(from)];
      says(from, &hb);
      c.OnMessage(from, peer::Message{from, c.Describe().term, hb});
    }
    now += std::chrono::milliseconds(20);
    c.Tick();
    for (const auto& [to, m] : network.sent) {
      const auto* r = std::get_if<peer::Restore>(&m.body);
      if (to == 1 && r != nullptr) return *r;
    }
  }
  return std::nullopt;
}

// Async replicas, 3 shards: the restore order the chief (shard 0, which keeps its part's copy
// (2, 5) and shard 2's (2, 3)) sends shard 1, and the tick it came at. Each tick both peers send a
// heartbeat: until tick `old_until`, one sent before they heard of any chief (term 0, no copies:
// old news on a slow link); after it, one of the chief's term listing `copies_then` (shard 1 keeps
// its own (2, 4) and shard 0's (2, 5), shard 2 its own (2, 3) and shard 1's (2, 4)) or none.
struct TimedOrder {
  peer::Restore order;
  int tick = 0;
  int claimed = -1;  // the tick shard 0 became chief at
};
// Shard `me` of 3 with async replicas (pushes applied on arrival), on the tests' clock settings.
ClusterOptions AsyncReplicaOptions(int me) {
  ClusterOptions options;
  options.me = me;
  options.addresses = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
  options.heartbeat_ms = 20;
  options.election_timeout_ms = 200;
  options.replicate = true;
  options.applies_on_arrival = true;
  return options;
}

std::optional<TimedOrder> AsyncChiefOrder(int old_until, bool copies_then) {
  const ClusterOptions options = AsyncReplicaOptions(0);
  RecordingHost host;
  host.own_copies = {{2, 5}};
  host.held_copies = {{2, 3}};
  RecordingNetwork network;
  Clock::time_point now = Clock::time_point{} + std::chrono::hours(1);
  ClusterCoordinator c(options, host, network, [&now] { return now; });
  c.Start();
  c.OnPeerUp(1);
  c.OnPeerUp(2);
  int claimed = -1;
  for (int t = 0; t < 200; ++t) {
    for (int from = 1; from <= 2; ++from) {
      peer::Heartbeat hb;
      hb.ready = true;
      hb.address = options.addresses[static_cast<size_t>(from)];
      uint64_t term = 0;
      if (t >= old_until) {
        term = c.Describe().term;
        hb.chief = c.chief();
        hb.epoch = 2;
        if (copies_then) {
          hb.own_copies = {from == 1 ? peer::LiveCopy{2, 4} : peer::LiveCopy{2, 3}};
          hb.held_copies = {from == 1 ? peer::LiveCopy{2, 5} : peer::LiveCopy{2, 4}};
        }
      }
      c.OnMessage(from, peer::Message{from, term, hb});
    }
    now += std::chrono::milliseconds(20);
    c.Tick();
    if (claimed < 0 && c.chief() == 0) claimed = t;
    for (const auto& [to, m] : network.sent) {
      const auto* r = std::get_if<peer::Restore>(&m.body);
      if (to == 1 && r != nullptr) return TimedOrder{*r, t, claimed};
    }
  }
  return std::nullopt;
}

// The chief's order with 3 shards: every shard wrote a part of step 4 and has step 2 sealed; the
// chief and shard 2 sealed step 4, shard 1 missed that seal (it lists step 4 unusable) and says
// its part of step 4 has checksum `shard1_part` (nullopt: it does not say, as an older version).
std::optional<peer::Restore> CheckpointOrder(std::optional<uint64_t> shard1_part) {
  auto part = [](int shard, uint64_t checksum) {
    return peer::PartInfo{shard, "part-" + std::to_string(shard), 100, checksum};
  };
  ShardHost::CheckpointScan scan;
  scan.sealed = {4, 2};
  scan.seals = {{4, {part(0, 40), part(1, 41), part(2, 42)}}, {2, {part(0, 20), part(1, 21), part(2, 22)}}};
  return ChiefOrderTo1(3, scan, [&](int from, peer::Heartbeat* hb) {
    if (from == 1) {
      hb->sealed_steps = {2};
      hb->unusable_steps = {4};
      if (shard1_part) hb->unsealed_parts[4] = part(1, *shard1_part);
    } else {
      hb->sealed_steps = {4, 2};
    }
  });
}

// The chief's order with 2 shards: both have steps 4 and 2 sealed; shard 1 gives `shard1_digests`
// as its manifests' digests (empty: it does not say, as an older version). `started`: as in
// ChiefOrderTo1.
std::optional<peer::Restore> SealedEverywhereOrder(const std::vector<uint64_t>& shard1_digests,
                                                   const std::function<void(ClusterCoordinator&)>& started = {}) {
  ShardHost::CheckpointScan scan;
  scan.sealed = {4, 2};
  scan.seals = {{4, {{0, "p0", 100, 40}, {1, "p1", 100, 41}}}, {2, {{0, "p0", 100, 20}, {1, "p1", 100, 21}}}};
  return ChiefOrderTo1(
      2, scan,
      [&](int, peer::Heartbeat* hb) {
        hb->sealed_steps = {4, 2};
        hb->seal_digests = shard1_digests;
      },
      started);
}

}  // namespace

// A new chief that has heard its peers only in heartbeats sent before they heard of it (old news,
// which may predate the copies they kept and acknowledged pushes with) does not fall back to a
// checkpoint on it: it waits, up to three election timeouts, for every shard to speak in its term.
TEST_CASE("coordinator: a new chief does not give up live copies on its peers' old news", "[cluster][replicas]") {
  // Old news for 15 ticks (300 ms) after the claim, then the copies: formed from the newest copy
  // of each part (no checkpoint, no empty start).
  auto fresh = AsyncChiefOrder(/*old_until=*/0, /*copies_then=*/true);
  REQUIRE(fresh.has_value());
  const int claimed = fresh->claimed;
  auto late = AsyncChiefOrder(claimed + 15, true);
  REQUIRE(late.has_value());
  CHECK(late->order.live);
  CHECK(late->order.newest);
  CHECK(late->tick >= claimed + 15);
  // The shards say in this term that they keep no copies: the copies of some part are gone, and
  // the fallback goes out at once.
  auto none = AsyncChiefOrder(0, false);
  REQUIRE(none.has_value());
  CHECK_FALSE(none->order.live);
  CHECK(none->tick <= none->claimed + 2);
  // Old news only: the fallback, but not before three election timeouts (30 ticks) after the claim.
  auto stale = AsyncChiefOrder(1000, false);
  REQUIRE(stale.has_value());
  CHECK_FALSE(stale->order.live);
  CHECK(stale->tick >= stale->claimed + 29);
}

TEST_CASE("coordinator: a step whose manifests differ between shards is restorable nowhere", "[cluster]") {
  const uint64_t seal2 = peer::SealDigest({{0, "p0", 100, 20}, {1, "p1", 100, 21}});
  const uint64_t seal4 = peer::SealDigest({{0, "p0", 100, 40}, {1, "p1", 100, 41}});
  // The same manifest of step 4 on both shards, or shard 1 does not say (an older version, or a
  // manifest it does not know): formed at step 4.
  for (const std::vector<uint64_t>& digests :
       {std::vector<uint64_t>{seal4, seal2}, std::vector<uint64_t>{}, std::vector<uint64_t>{0, seal2}}) {
    auto order = SealedEverywhereOrder(digests);
    REQUIRE(order.has_value());
    CHECK(order->step == 4);
  }
  // Shard 1 sealed another timeline's parts of step 4 (a stand-in and its own process each wrote
  // one): neither manifest can be restored by both shards. Formed at step 2, not at step 4 (which
  // shard 1 would refuse only after shard 0 had restored it).
  const uint64_t other4 = peer::SealDigest({{0, "p0", 100, 40}, {1, "p1", 100, 99}});
  auto order = SealedEverywhereOrder({other4, seal2});
  REQUIRE(order.has_value());
  CHECK(order->step == 2);
}

// A shard that writes its part of a step it holds sealed again (another timeline's snapshot of the
// step: async, after the cluster re-formed from live copies at counts below it) no longer has that
// checkpoint: the manifest on disk names the part replaced. (Found by async seed 460576: the shard
// went on saying the step was sealed, and its chief asked an operator to give up a checkpoint that
// no shard could restore.)
TEST_CASE("coordinator: a part written over a sealed step unseals it", "[cluster]") {
  auto written = [](uint64_t checksum) {
    return [checksum](ClusterCoordinator& c) { c.OnPartWritten(7, 4, {0, "p0", 100, checksum}); };
  };
  // The part its manifest names, written again (the same snapshot): still sealed, formed at step 4.
  auto order = SealedEverywhereOrder({}, written(40));
  REQUIRE(order.has_value());
  CHECK(order->step == 4);
  // Another part: step 4 is restorable on shard 1 only; formed at step 2.
  order = SealedEverywhereOrder({}, written(77));
  REQUIRE(order.has_value());
  CHECK(order->step == 2);
}

TEST_CASE("coordinator: a seal goes with a restore order only to a shard whose part it names", "[cluster]") {
  // Shard 1's part of step 4 is the one the seal names (it missed the seal): the cluster forms at
  // step 4, the order carrying the seal. So too when shard 1 does not say which part it holds.
  for (std::optional<uint64_t> part : {std::optional<uint64_t>(41), std::optional<uint64_t>()}) {
    auto order = CheckpointOrder(part);
    REQUIRE(order.has_value());
    CHECK(order->step == 4);
    CHECK(order->seal.size() == 3);
  }
  // Another part of step 4 (written in a timeline that left the sealed one): the seal would be
  // refused there, after the other shards had restored step 4. The cluster forms at step 2 (the
  // order carries that step's manifest, as every checkpoint order does).
  auto order = CheckpointOrder(99);
  REQUIRE(order.has_value());
  CHECK(order->step == 2);
}

namespace {

// A host whose restores finish at once and that records the steps it is asked to commit.
class CommitRecordingHost : public RecordingHost {
 public:
  Status CommitStep(uint64_t, int64_t step, bool, double) override {
    commits.push_back(step);
    return Status::Ok();
  }
  void RestoreAsync(uint64_t epoch, int64_t, const std::vector<peer::PartInfo>&, RestoreDone done) override {
    restores.push_back(epoch);
    done(Status::Ok(), {});
  }
  std::vector<int64_t> commits;
};

// A host that keeps its copies as two strings: what KeepCopy gives (as if a difference) and the
// copy whole (SerializedCopy).
class CopyingHost : public CommitRecordingHost {
 public:
  std::shared_ptr<const peer::CopyBytes> KeepCopy(uint64_t, const peer::LiveCopy&,
                                                  std::optional<peer::LiveCopy>) override {
    return std::make_shared<peer::CopyBytes>(std::string("a difference"));
  }
  std::shared_ptr<const peer::CopyBytes> SerializedCopy(int, const peer::LiveCopy&) override {
    ++whole_asked;
    return std::make_shared<peer::CopyBytes>(std::string("the copy whole"));
  }
  int whole_asked = 0;
};

template <typename T>
bool Is(const peer::Message& m) {
  return std::holds_alternative<T>(m.body);
}

// Shard 1 of 3 on a manual clock, linked to both others, following chief 0 (term 3). `lane`: the
// coordinator's (empty: its actions run inline).
struct Follower {
  Follower(CommitRecordingHost& host, bool replicate, std::function<void(std::function<void()>)> lane = {}) {
    options.me = 1;
    options.addresses = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
    options.heartbeat_ms = 20;
    options.election_timeout_ms = 200;
    options.replicate = replicate;
    c = std::make_unique<ClusterCoordinator>(
        options, host, network, [this] { return now; }, nullptr, std::move(lane));
    c->Start();
    c->OnPeerUp(0);
    c->OnPeerUp(2);
    ChiefHeartbeat();
  }
  void ChiefHeartbeat() {
    peer::Heartbeat hb;
    hb.chief = 0;
    hb.epoch = 3;
    hb.running = true;
    hb.ready = true;
    hb.address = options.addresses[0];
    c->OnMessage(0, peer::Message{0, 3, hb});
  }
  // The chief's orders: restore epoch 3 empty; commit `step`.
  void Restore() {
    peer::Restore r;
    r.epoch = 3;
    r.step = -1;
    c->OnMessage(0, peer::Message{0, 3, r});
  }
  void Commit(int64_t step) {
    peer::Commit commit;
    commit.epoch = 3;
    commit.step = step;
    c->OnMessage(0, peer::Message{0, 3, commit});
  }
  // Messages of kind T sent to `to`.
  template <typename T>
  int Sent(int to) const {
    return static_cast<int>(std::count_if(network.sent.begin(), network.sent.end(),
                                          [&](const auto& sent) { return sent.first == to && Is<T>(sent.second); }));
  }
  // The copies' pieces sent to `to`, as strings, in order.
  std::vector<std::string> ChunksTo(int to) const {
    std::vector<std::string> out;
    for (const auto& [shard, m] : network.sent) {
      if (const auto* chunk = std::get_if<peer::ReplicaChunk>(&m.body); chunk != nullptr && shard == to) {
        out.emplace_back(chunk->data.data(), chunk->data.size());
      }
    }
    return out;
  }

  ClusterOptions options;
  Clock::time_point now = Clock::time_point{} + std::chrono::hours(1);
  RecordingNetwork network;
  std::unique_ptr<ClusterCoordinator> c;
};

}  // namespace

// Async stand-ins: a shard that restored its part for an epoch counts the parts as served by the
// processes its map names from then on, before it hears the epoch serve (it may never: cut off
// right after its reply). A part a stand-in serves is then said in its heartbeats, and a formation
// it leads waits for the stand-in's host. (Async seed 487769: it formed from older copies of that
// part than the host kept, and lost the pushes acknowledged there.)
TEST_CASE("coordinator: a shard counts the parts served from its restore on", "[cluster][takeover]") {
  for (bool restores : {false, true}) {
    CAPTURE(restores);
    CommitRecordingHost host;
    const ClusterOptions options = AsyncReplicaOptions(1);
    RecordingNetwork network;
    Clock::time_point now = Clock::time_point{} + std::chrono::hours(1);
    ClusterCoordinator c(options, host, network, [&now] { return now; });
    c.Start();
    c.OnPeerUp(0);
    c.OnPeerUp(2);
    // Chief 0 (term 3), forming epoch 3, not serving yet; shard 2 is served by a stand-in.
    peer::Heartbeat hb;
    hb.chief = 0;
    hb.epoch = 2;
    hb.ready = true;
    hb.address = options.addresses[0];
    hb.moved = {{2, "127.0.0.1:902"}};
    c.OnMessage(0, peer::Message{0, 3, hb});
    REQUIRE(c.Addresses()[2] == "127.0.0.1:902");
    if (restores) {
      peer::Restore r;
      r.epoch = 3;
      r.step = -1;
      r.moved = hb.moved;  // (the chief's order carries its map)
      c.OnMessage(0, peer::Message{0, 3, r});
      REQUIRE(c.Describe().epoch == 3);
    }
    network.sent.clear();
    now += std::chrono::milliseconds(20);
    c.Tick();
    std::vector<peer::PartServed> said;
    for (const auto& [to, m] : network.sent) {
      if (const auto* h = std::get_if<peer::Heartbeat>(&m.body); h != nullptr && to == 0) said = h->served_parts;
    }
    if (restores) {
      REQUIRE(said.size() == 3);
      CHECK(said[2] == peer::PartServed{3, true});
      CHECK(said[1] == peer::PartServed{3, false});
      CHECK(said[0] == peer::PartServed{3, false});
    } else {
      CHECK(std::none_of(said.begin(), said.end(), [](const peer::PartServed& p) { return p.epoch > 0; }));
    }
  }
}

// A chief's heartbeats can wait behind a copy of its part hundreds of MiB long, on the link or being
// taken here: the copy's pieces of this epoch, which only the process serving the chief's shard
// sends, count as the chief's life. Pieces of another epoch or term (a process that no longer
// serves it, say) do not. (psd_bench --sparse --shards 3 --replicas-per-shard 2 --optimizer adam
// saw the chief's heartbeats 0.5-1.8 s apart at the next shard, which counted the chief gone.)
TEST_CASE("coordinator: a copy the chief is sending keeps it alive", "[cluster][replicas]") {
  for (int variant = 0; variant < 3; ++variant) {
    CAPTURE(variant);
    CommitRecordingHost host;
    Follower f(host, /*replicate=*/true);
    f.Restore();
    REQUIRE(f.c->Describe().epoch == 3);
    const uint64_t epoch = variant == 1 ? 2 : 3;
    const uint64_t term = variant == 2 ? 2 : 3;
    int chief_until = -1;           // the last tick shard 0 was still the chief at
    for (int i = 0; i < 50; ++i) {  // 1 s, five election timeouts, without a heartbeat of the chief
      peer::ReplicaChunk chunk{epoch, 0, {epoch, 1}, false, static_cast<uint64_t>(i) * 8, 1 << 20, {}};
      chunk.data = peer::Blob(std::string(8, 'x'));
      f.c->OnMessage(0, peer::Message{0, term, chunk});
      f.now += std::chrono::milliseconds(20);
      f.c->Tick();
      if (f.c->chief() == 0) chief_until = i;
    }
    if (variant == 0) {
      CHECK(chief_until == 49);
    } else {
      CHECK(chief_until < 12);  // gone after an election timeout (10 ticks)
    }
  }
}

// A stand-in and its shard's own process both speak as shard 0 here, and each may claim a term the
// other never heard of (cluster simulation seed 732927: both formed epoch 6 from different steps;
// the other shard took the stand-in's restore order, then answered shard 0's own process with it,
// and the two shards served different states). Within a term this shard follows the process whose
// order came first, and addresses its answers to it.
TEST_CASE("coordinator: within a term a shard follows one process of the chief's index", "[cluster][takeover]") {
  CommitRecordingHost host;
  Follower f(host, /*replicate=*/false);
  const uint64_t a = 0xa, b = 0xb;
  auto from = [&](uint64_t process, uint64_t term, peer::Body body) {
    f.c->OnMessage(0, peer::Message{0, term, std::move(body), process});
  };
  auto restore = [](uint64_t epoch) {
    peer::Restore r;
    r.epoch = epoch;
    return r;
  };
  auto answers = [&](uint64_t to) {
    int n = 0;
    for (const auto& [shard, m] : f.network.sent) {
      if (shard == 0 && m.to == to && (Is<peer::Restored>(m) || Is<peer::Committed>(m))) ++n;
    }
    return n;
  };
  from(a, 6, restore(6));
  REQUIRE(host.restores == std::vector<uint64_t>{6});
  CHECK(answers(a) == 1);
  CHECK(f.c->chief() == 0);
  // Process b's order for the same epoch: not taken, not answered (a's answer is not b's).
  from(b, 6, restore(6));
  from(b, 6, peer::Commit{6, 0, false, 0.1});
  CHECK(host.restores == std::vector<uint64_t>{6});
  CHECK(host.commits.empty());
  CHECK(answers(b) == 0);
  // Process a's commit is.
  from(a, 6, peer::Commit{6, 0, false, 0.1});
  CHECK(host.commits == std::vector<int64_t>{0});
  CHECK(answers(a) == 2);
  // Only b is heard from now on (a's host stopped it): b's heartbeats are not a's life, and the
  // chief is counted gone after an election timeout...
  for (int i = 0; i < 15; ++i) {
    peer::Heartbeat hb;
    hb.chief = 0;
    hb.epoch = 6;
    hb.ready = true;
    hb.address = f.options.addresses[0];
    from(b, 6, hb);
    f.now += std::chrono::milliseconds(20);
    f.c->Tick();
  }
  CHECK(f.c->chief() == -1);
  from(b, 6, restore(6));
  CHECK(host.restores == std::vector<uint64_t>{6});
  // ...and b, forming again in a higher term, leads.
  from(b, 7, restore(7));
  CHECK(host.restores == std::vector<uint64_t>{6, 7});
  CHECK(answers(b) == 1);
}

// The chief's side: an answer addressed to another process of its index (an order of a stand-in
// that served it, say) does not count for its formation.
TEST_CASE("coordinator: a chief counts only the answers to its own orders", "[cluster][takeover]") {
  CommitRecordingHost host;
  ClusterOptions options;
  options.me = 0;
  options.addresses = {"127.0.0.1:1", "127.0.0.1:2"};
  options.heartbeat_ms = 20;
  options.election_timeout_ms = 200;
  RecordingNetwork network;
  Clock::time_point now = Clock::time_point{} + std::chrono::hours(1);
  ClusterCoordinator c(options, host, network, [&now] { return now; });
  c.Start();
  c.OnPeerUp(1);
  std::optional<peer::Message> order;
  for (int t = 0; t < 40 && !order; ++t) {
    peer::Heartbeat hb;
    hb.chief = c.chief();
    hb.ready = true;
    hb.address = options.addresses[1];
    c.OnMessage(1, peer::Message{1, c.Describe().term, hb, /*sender=*/0x1});
    now += std::chrono::milliseconds(20);
    c.Tick();
    for (const auto& [to, m] : network.sent) {
      if (Is<peer::Restore>(m) && to == 0) order = m;
    }
  }
  REQUIRE(order);
  REQUIRE(order->sender != 0);
  const uint64_t epoch = std::get<peer::Restore>(order->body).epoch;
  network.sent.clear();
  c.OnMessage(0, *order);  // its own restore; its answer to itself
  for (const auto& [to, m] : network.sent) {
    if (Is<peer::Restored>(m) && to == 0) {
      CHECK(m.to == order->sender);
      c.OnMessage(0, m);
    }
  }
  peer::Message other{1, epoch, peer::Restored{epoch, -1, true, "", {}}, 0x1, /*to=*/order->sender + 1};
  c.OnMessage(1, other);
  CHECK(c.Describe().state != "running");
  peer::Message mine = other;
  mine.to = order->sender;
  c.OnMessage(1, mine);
  CHECK(c.Describe().state == "running");
}

namespace {

// Shard 0 of 3 with replicas (no takeover): shard 2 led term 2 and its link closes, so this shard
// claims the chief role; it holds its part at step 5 (it took the commit of step 4), while the
// others say, at term `peers_term`, they hold shard 1's part at step 4 only. Ticks `ticks` times
// hearing both; the step of the restore order sent, or -2 if none went out.
int64_t FormedAfterClaim(uint64_t peers_term, int ticks) {
  Shard s(0, 3);
  s.options.takeover_after = std::chrono::milliseconds(0);
  s.coordinator = std::make_unique<ClusterCoordinator>(s.options, s.host, s.network, [&s] { return s.now; });
  s.coordinator->Start();
  s.coordinator->OnPeerUp(1);
  s.coordinator->OnPeerUp(2);
  s.host.own_copies = {{2, 5}, {2, 4}};
  s.host.held_copies = {{2, 5}, {2, 4}};  // shard 2's part
  auto hears = [&](int from, uint64_t term, int chief) {
    peer::Heartbeat hb;
    hb.chief = chief;
    hb.ready = true;
    hb.address = s.options.addresses[static_cast<size_t>(from)];
    if (from == 1) {
      hb.own_copies = {{2, 4}, {2, 3}};  // its own part: step 4 (as it said before it committed 5)
      hb.held_copies = {{2, 5}, {2, 4}};
    } else {
      hb.own_copies = {{2, 5}, {2, 4}};
      hb.held_copies = {{2, 4}, {2, 3}};  // shard 1's part
    }
    s.coordinator->OnMessage(from, peer::Message{from, term, hb, /*sender=*/0x100 + static_cast<uint64_t>(from)});
  };
  for (int t = 0; t < 5; ++t) {
    hears(2, 2, 2);
    hears(1, 2, 2);
    s.Tick();
  }
  REQUIRE(s.coordinator->chief() == 2);
  s.coordinator->OnPeerDown(2);
  for (int t = 0; t < 60 && !s.coordinator->is_chief(); ++t) {
    hears(1, 2, 2);
    s.Tick();
  }
  REQUIRE(s.coordinator->is_chief());
  const uint64_t term = s.coordinator->Describe().term;
  s.coordinator->OnPeerUp(2);
  s.network.sent.clear();
  for (int t = 0; t < ticks; ++t) {
    hears(1, peers_term == 0 ? term : peers_term, peers_term == 0 ? 0 : 2);
    hears(2, peers_term == 0 ? term : peers_term, peers_term == 0 ? 0 : -1);
    s.Tick();
    for (const auto& [to, m] : s.network.sent) {
      if (const auto* r = std::get_if<peer::Restore>(&m.body)) return r->step;
    }
  }
  return -2;
}

}  // namespace

// A new chief whose own part is past the step every part has a copy of: a shard that has not heard
// its claim may still commit that step for the last chief, which then releases it (sync seed
// 983275: the last chief's link to the new one closed, its link to a third shard was slow; the
// new chief formed at step 4 from that shard's news while it committed step 5). The chief waits
// until every shard speaks in its term (then their copies are final news), up to three election
// timeouts.
TEST_CASE("coordinator: a new chief ahead of the copies it heard of waits for news of its term",
          "[cluster][replicas]") {
  // Heard in its term: shard 1 holds its part at step 4 only, so step 5 was never released.
  CHECK(FormedAfterClaim(0, 10) == 4);
  // Heard only in the last chief's term: no order for two election timeouts...
  CHECK(FormedAfterClaim(2, 20) == -2);
  // ...then the choice stands (logged as old news, not silently).
  CHECK(FormedAfterClaim(2, 60) == 4);
}

// The daemon runs a coordinator's actions on a lane of their own: a commit whose apply and copy
// take seconds must not hold back the heartbeats this shard sends, nor those it hears (they come
// on the same link as the commit). Here the lane holds the commit's batch for ten election
// timeouts: the chief's heartbeats keep it the chief, this shard's go out at every tick, and the
// commit runs, then is answered, once the lane runs it.
TEST_CASE("coordinator: actions wait on the lane while heartbeats go on", "[cluster][lane]") {
  CommitRecordingHost host;
  std::vector<std::function<void()>> lane;
  auto run_lane = [&] {
    // In order; a batch may hand over more (a restore that finished decides the reply).
    for (size_t i = 0; i < lane.size(); ++i) {
      auto batch = std::move(lane[i]);
      batch();
    }
    lane.clear();
  };
  Follower f(host, /*replicate=*/false, [&](std::function<void()> batch) { lane.push_back(std::move(batch)); });
  f.Restore();
  CHECK(host.restores.empty());  // decided, not run inside the call
  run_lane();
  REQUIRE(host.restores == std::vector<uint64_t>{3});
  REQUIRE(f.Sent<peer::Restored>(0) == 1);

  f.Commit(0);
  CHECK(host.commits.empty());
  REQUIRE(!lane.empty());
  const int before = f.Sent<peer::Heartbeat>(2);
  for (int i = 0; i < 100; ++i) {  // 2 s: ten election timeouts, the lane held
    f.now += std::chrono::milliseconds(20);
    f.ChiefHeartbeat();
    f.c->Tick();
    REQUIRE(f.c->chief() == 0);
  }
  CHECK(f.Sent<peer::Heartbeat>(2) - before == 100);
  CHECK(host.commits.empty());
  CHECK(f.Sent<peer::Committed>(0) == 0);
  run_lane();
  CHECK(host.commits == std::vector<int64_t>{0});
  CHECK(f.Sent<peer::Committed>(0) == 1);
  CHECK(f.c->Describe().term == 3);
}

// A next shard that cannot use a copy (a difference from a copy it lost when it restarted) says
// so in its ack; the owner sends the copy whole at once (once per copy: after that, the ack's
// timeout resends), rather than after the timeout. The commit is answered once the whole copy is
// acknowledged.
TEST_CASE("coordinator: a copy the next shard cannot use is sent whole when it says so", "[cluster][replicas]") {
  CopyingHost host;
  Follower f(host, /*replicate=*/true);
  f.Restore();
  REQUIRE(host.restores == std::vector<uint64_t>{3});
  // The restored state is copied to the next shard before the chief hears of the restore.
  REQUIRE(f.ChunksTo(2).size() == 1);
  f.c->OnMessage(2, peer::Message{2, 3, peer::ReplicaAck{3, peer::LiveCopy{3, 0}}});
  REQUIRE(f.Sent<peer::Restored>(0) == 1);
  f.Commit(0);
  REQUIRE(host.commits == std::vector<int64_t>{0});
  REQUIRE(f.ChunksTo(2) == std::vector<std::string>{"a difference", "a difference"});
  CHECK(f.Sent<peer::Committed>(0) == 0);

  const peer::LiveCopy copy{3, 1};  // the epoch's lineage, the step published
  f.c->OnMessage(2, peer::Message{2, 3, peer::ReplicaAck{3, copy, /*send_whole=*/true}});
  CHECK(host.whole_asked == 1);
  CHECK(f.ChunksTo(2) == std::vector<std::string>{"a difference", "a difference", "the copy whole"});
  CHECK(f.Sent<peer::Committed>(0) == 0);
  // Said again (the whole copy did not do either): left to the ack's timeout.
  f.c->OnMessage(2, peer::Message{2, 3, peer::ReplicaAck{3, copy, /*send_whole=*/true}});
  CHECK(f.ChunksTo(2).size() == 3);
  // Another copy's refusal is not this one's.
  f.c->OnMessage(2, peer::Message{2, 3, peer::ReplicaAck{3, peer::LiveCopy{3, 7}, /*send_whole=*/true}});
  CHECK(f.ChunksTo(2).size() == 3);
  f.c->OnMessage(2, peer::Message{2, 3, peer::ReplicaAck{3, copy}});
  CHECK(f.Sent<peer::Committed>(0) == 1);
}

// A copy whose ack does not come is sent again, but not while its last sending is still going out
// (sendings of a big copy queued behind each other held up everything else on the link: ten whole
// copies of 488 MiB during a 12 s pause), and the wait counts from its last piece, doubling.
TEST_CASE("coordinator: a copy still going out is not sent again, and each sending again waits longer",
          "[cluster][replicas]") {
  CopyingHost host;
  Follower f(host, /*replicate=*/true);
  f.network.hold_streams = true;
  f.Restore();  // the restored state is copied to the next shard before the chief hears of it
  REQUIRE(f.network.held.size() == 1);
  auto tick = [&](int ms) {
    f.now += std::chrono::milliseconds(ms);
    f.ChiefHeartbeat();
    f.c->Tick();
  };
  for (int i = 0; i < 10; ++i) tick(200);  // 2 s: still going out, so not sent again
  CHECK(f.network.held.size() == 1);
  CHECK(host.whole_asked == 0);
  f.network.Drain();  // its last piece went now
  tick(150);
  CHECK(f.network.held.empty());
  tick(100);  // 250 ms after its last piece, past the election timeout (200 ms): sent again whole
  REQUIRE(f.network.held.size() == 1);
  CHECK(host.whole_asked == 1);
  f.network.Drain();
  tick(300);  // the wait doubled (400 ms)
  CHECK(f.network.held.empty());
  tick(150);
  CHECK(f.network.held.size() == 1);
  // The network lets a sending go unfinished (its link broke, its queue was full): that ends it
  // too, and the copy is sent again after the wait (doubled again: 800 ms).
  f.network.held.clear();
  tick(700);
  CHECK(f.network.held.empty());
  tick(150);
  CHECK(f.network.held.size() == 1);
  // Acknowledged: nothing more is sent, and a sending still under way stops.
  f.c->OnMessage(2, peer::Message{2, 3, peer::ReplicaAck{3, peer::LiveCopy{3, 0}}});
  CHECK(f.Sent<peer::Restored>(0) == 1);
  const size_t before = f.ChunksTo(2).size();
  f.network.Drain();
  CHECK(f.ChunksTo(2).size() == before);
  for (int i = 0; i < 10; ++i) tick(200);
  CHECK(f.network.held.empty());
}

namespace {

class RefusingHost : public RecordingHost {
 public:
  Status TakeCopy(int, const peer::LiveCopy&, std::shared_ptr<const std::string>) override {
    return FailedPrecondition("the copy is a difference from step 0, which this shard does not keep");
  }
};

// Shard 2 of 3 with replicas, linked to shard 1, whose copies it keeps.
struct NextShard {
  explicit NextShard(ShardHost& host) {
    options.me = 2;
    options.addresses = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
    options.replicate = true;
    c = std::make_unique<ClusterCoordinator>(options, host, network);
    c->Start();
    c->OnPeerUp(1);
  }
  // A piece [offset, offset + data's size) of shard 1's copy `copy` (epoch 3), of `total` bytes.
  void Piece(const peer::LiveCopy& copy, uint64_t offset, uint64_t total, const std::string& data) {
    c->OnMessage(1, peer::Message{1, 3, peer::ReplicaChunk{3, 1, copy, false, offset, total, peer::Blob(data)}});
  }
  // The acks sent to shard 1.
  std::vector<peer::ReplicaAck> Acks() const {
    std::vector<peer::ReplicaAck> acks;
    for (const auto& [to, m] : network.sent) {
      if (const auto* a = std::get_if<peer::ReplicaAck>(&m.body); a != nullptr && to == 1) acks.push_back(*a);
    }
    return acks;
  }
  ClusterOptions options;
  RecordingNetwork network;
  std::unique_ptr<ClusterCoordinator> c;
};

}  // namespace

// The other side: the next shard answers a copy it cannot keep with an ack that asks for it whole
// (and one it keeps with a plain ack, as the tests above show).
TEST_CASE("coordinator: a copy that cannot be kept is answered by asking for it whole", "[cluster][replicas]") {
  RefusingHost host;
  NextShard next(host);
  const std::string bytes = "a difference";
  next.Piece(peer::LiveCopy{3, 1}, 0, bytes.size(), bytes);
  std::vector<peer::ReplicaAck> acks = next.Acks();
  REQUIRE(acks.size() == 1);
  CHECK(acks[0].send_whole);
  CHECK(acks[0].copy == peer::LiveCopy{3, 1});
}

namespace {

// Keeps every copy; `during` runs while it takes one (a stand-in stopped meanwhile).
class SlowTakingHost : public RecordingHost {
 public:
  Status TakeCopy(int, const peer::LiveCopy&, std::shared_ptr<const std::string>) override {
    if (during) during();
    return Status::Ok();
  }
  std::function<void()> during;
};

}  // namespace

// A stand-in being stopped lists the copies it keeps for its host to hand back (Leaving): a copy it
// acknowledged after that would be lost with it while its owner counts it kept. Stopped while it
// takes one, it does not acknowledge it.
TEST_CASE("coordinator: a coordinator stopped while it takes a copy does not acknowledge it", "[cluster][takeover]") {
  SlowTakingHost host;
  NextShard next(host);
  const std::string bytes = "a copy";
  next.Piece(peer::LiveCopy{3, 1}, 0, bytes.size(), bytes);
  CHECK(next.Acks().size() == 1);
  host.during = [&] { next.c->Stop(); };
  next.Piece(peer::LiveCopy{3, 2}, 0, bytes.size(), bytes);
  CHECK(next.Acks().size() == 1);
}

// A copy's pieces from a shard whose link went down will not be finished (a new sending starts at
// its first piece): they are not held until then.
TEST_CASE("coordinator: the pieces of a copy whose link went down are let go", "[cluster][replicas]") {
  SlowTakingHost host;
  NextShard next(host);
  const std::string first = "the first half ", second = "and the second";
  const uint64_t total = first.size() + second.size();
  const peer::LiveCopy copy{3, 1};
  int taken = 0;
  host.during = [&] { ++taken; };
  next.Piece(copy, 0, total, first);
  next.c->OnPeerDown(1);
  next.c->OnPeerUp(1);
  next.Piece(copy, first.size(), total, second);  // the rest of a sending whose start is gone: not a copy
  CHECK(taken == 0);
  next.Piece(copy, 0, total, first);  // sent again whole, from its first piece
  next.Piece(copy, first.size(), total, second);
  CHECK(taken == 1);
}

namespace {

// The chief (shard 1 of 3, async with replicas and takeover) of the side of a partition that has
// shard 2's own process and, once it has claimed, a stand-in for shard 0; shard 0's own process is
// silent. Every part has a copy on this side; shard 2's heartbeats say `served` (which parts a
// stand-in served last). After 30 heartbeats with the stand-in, and then `more` heartbeats with shard 0's own process
// heard too: whether a formation's restore order went out, and what the chief said.
struct Formed {
  bool restored = false;
  std::string state;
  bool restored_later = false;
};
Formed AsyncChiefWithoutShard0(const std::vector<peer::PartServed>& served, int more) {
  Shard s(1, 3);
  s.options.applies_on_arrival = true;
  s.coordinator = std::make_unique<ClusterCoordinator>(s.options, s.host, s.network, [&s] { return s.now; });
  s.coordinator->Start();
  s.coordinator->OnPeerUp(0);
  s.coordinator->OnPeerUp(2);
  auto hears = [&](int from, bool stand_in) {
    peer::Heartbeat hb;
    hb.chief = s.coordinator->chief();
    hb.ready = true;
    hb.stand_in = stand_in;
    hb.address = stand_in ? Shard::StandInAddress(from) : s.options.addresses[static_cast<size_t>(from)];
    if (from == 0) {
      hb.own_copies = {{5, 40}};  // part 0 (from shard 1's copies, say)
    } else {
      hb.own_copies = {{2, 9}};    // part 2: its own process's older copies
      hb.held_copies = {{5, 20}};  // part 1's copies
      hb.served_parts = served;
    }
    s.coordinator->OnMessage(from, peer::Message{from, s.coordinator->Describe().term, hb});
  };
  auto restore_sent = [&] {
    for (const auto& [to, m] : s.network.sent) {
      if (std::holds_alternative<peer::Restore>(m.body)) return true;
    }
    return false;
  };
  for (int t = 0; t < 15; ++t) {  // shard 0 silent: this shard claims the chief role
    hears(2, /*stand_in=*/false);
    s.Tick();
  }
  REQUIRE(s.coordinator->is_chief());
  for (int t = 0; t < 30; ++t) {  // then the stand-in for shard 0 (run here) is heard
    hears(0, /*stand_in=*/true);
    hears(2, /*stand_in=*/false);
    s.Tick();
  }
  REQUIRE(s.coordinator->Addresses()[0] == Shard::StandInAddress(0));
  Formed f{restore_sent(), s.coordinator->Describe().state, false};
  for (int t = 0; t < more; ++t) {
    hears(0, /*stand_in=*/false);
    hears(2, /*stand_in=*/false);
    s.Tick();
  }
  f.restored_later = restore_sent();
  return f;
}

}  // namespace

TEST_CASE("coordinator: in async a part a stand-in served last waits for its host's own process",
          "[cluster][takeover]") {
  // Part 2 was served by a stand-in on shard 0's host in epoch 7: its newest copies are there,
  // perhaps with pushes acknowledged after this side last heard of that host. Forming from shard
  // 2's own older copies would lose them: the chief waits, and says for whom.
  Formed f = AsyncChiefWithoutShard0({{7, false}, {7, false}, {7, true}}, 0);
  CHECK_FALSE(f.restored);
  CHECK(f.state.find("waiting for shard 0 (127.0.0.1:1): it keeps the newest copies of shard 2's part") !=
        std::string::npos);
  // Shard 0's own process heard again: the formation goes ahead.
  CHECK(AsyncChiefWithoutShard0({{7, false}, {7, false}, {7, true}}, 30).restored_later);
  // An epoch since (8) served part 2 through its own process: nothing to wait for.
  CHECK(AsyncChiefWithoutShard0({{8, false}, {8, false}, {8, false}}, 0).restored);
  // Nobody said a stand-in served it: the formation goes ahead at once.
  CHECK(AsyncChiefWithoutShard0({}, 0).restored);
}

TEST_CASE("coordinator: a new epoch is numbered above every copy's lineage it knows of", "[cluster][replicas]") {
  // Shard 1 kept copies of an epoch (9) formed on its side of a partition, which never ran; this
  // shard's own terms are far lower. Copies are ordered by lineage: an epoch numbered 9 or below
  // would order its own newer copies below those older ones, and a later formation from each
  // part's newest copy would drop what it served (async: pushes acknowledged).
  Shard s(0, 2);
  s.options.applies_on_arrival = true;
  s.coordinator = std::make_unique<ClusterCoordinator>(s.options, s.host, s.network, [&s] { return s.now; });
  s.coordinator->Start();
  s.coordinator->OnPeerUp(1);
  uint64_t formed = 0;
  for (int t = 0; t < 40 && formed == 0; ++t) {
    peer::Heartbeat hb;
    hb.chief = s.coordinator->chief();
    hb.ready = true;
    hb.address = s.options.addresses[1];
    hb.own_copies = {{9, 0}};   // part 1, of epoch 9
    hb.held_copies = {{2, 5}};  // part 0
    s.coordinator->OnMessage(1, peer::Message{1, s.coordinator->Describe().term, hb});
    s.Tick();
    for (const auto& [to, m] : s.network.sent) {
      if (const auto* r = std::get_if<peer::Restore>(&m.body)) formed = r->epoch;
    }
  }
  REQUIRE(s.coordinator->is_chief());
  CHECK(formed > 9);
}

namespace {

// Two shards, async with replicas: epoch 3 served shard 1's part (through a stand-in on shard 0's
// host), and meanwhile shard 1's own process, cut off and chief of its side, formed epoch 4 alone
// (it restored an empty state and never ran). Ordered by lineage, that restore's copy (4, 0) is
// above the copies of epoch 3, which hold the pushes acknowledged there.
peer::Heartbeat ServedHeartbeat(const Shard& s, int from, uint64_t served) {
  peer::Heartbeat hb;
  hb.chief = from;
  hb.ready = true;
  hb.address = s.options.addresses[static_cast<size_t>(from)];
  hb.served_parts = {{served, false}, {served, true}};
  return hb;
}

// Shard 0 keeps `held` of shard 1's part and has heard that epoch `served` served it last; what
// it answers shard 1's newest fetch with (its own newest restorable copy being `have`).
peer::LiveCopy NewestFetchAnswer(const std::vector<peer::LiveCopy>& held, uint64_t served, peer::LiveCopy have) {
  Shard s(0, 2);
  s.options.applies_on_arrival = true;
  s.coordinator = std::make_unique<ClusterCoordinator>(s.options, s.host, s.network, [&s] { return s.now; });
  s.coordinator->Start();
  s.coordinator->OnPeerUp(1);
  s.host.held_copies = held;
  s.coordinator->OnMessage(1, peer::Message{1, 1, ServedHeartbeat(s, 1, served)});
  s.network.sent.clear();
  s.coordinator->OnMessage(1, peer::Message{1, 1, peer::ReplicaFetch{6, have, /*newest=*/true}});
  for (const auto& [to, m] : s.network.sent) {
    if (const auto* c = std::get_if<peer::ReplicaChunk>(&m.body); c != nullptr && to == 1 && c->restore) {
      return c->copy;
    }
  }
  FAIL("no answer to the fetch");
  return {};
}

}  // namespace

TEST_CASE("coordinator: a copy of an epoch that never served its part is not restored over one that did",
          "[cluster][replicas]") {
  const peer::LiveCopy never{4, 0}, served{3, 5};
  // The next shard (the stand-in's host) keeps both: it answers with the one epoch 3 kept.
  CHECK(NewestFetchAnswer({never, served}, 3, {0, -1}) == served);
  // Epoch 4 did serve the part (heard of): its copy is the newest, as before.
  CHECK(NewestFetchAnswer({never, served}, 4, {0, -1}) == never);
  // Nothing is known to have served it: as before.
  CHECK(NewestFetchAnswer({never, served}, 0, {0, -1}) == never);
  // The fetcher's own restorable copy is newer: it restores that one (the answer is its own, back).
  CHECK(NewestFetchAnswer({never, served}, 3, {3, 6}) == peer::LiveCopy{3, 6});
  // Only the copy of the epoch that never ran is kept here: it is sent rather than nothing.
  CHECK(NewestFetchAnswer({never}, 3, {0, -1}) == never);

  // The fetcher: shard 1's own process keeps (4, 0) and an older copy of epoch 3's, and hears that
  // epoch 3 served its part last. Epoch 6 is formed from the newest copies.
  Shard s(1, 2);
  s.options.applies_on_arrival = true;
  s.coordinator = std::make_unique<ClusterCoordinator>(s.options, s.host, s.network, [&s] { return s.now; });
  s.coordinator->Start();
  s.coordinator->OnPeerUp(0);
  s.host.own_copies = {never, {3, 2}};
  s.coordinator->OnMessage(0, peer::Message{0, 1, ServedHeartbeat(s, 0, 3)});
  auto fetched = [&s](uint64_t epoch) {
    std::optional<peer::ReplicaFetch> fetch;
    for (const auto& [to, m] : s.network.sent) {
      const auto* f = std::get_if<peer::ReplicaFetch>(&m.body);
      if (f != nullptr && to == 0 && f->epoch == epoch) fetch = *f;
    }
    return fetch;
  };
  auto order = [&s](uint64_t epoch) {
    s.coordinator->OnMessage(0, peer::Message{0, epoch, peer::Restore{epoch, -1, {}, true, 0, /*newest=*/true}});
  };
  order(6);
  auto fetch = fetched(6);
  REQUIRE(fetch.has_value());
  CHECK(fetch->newest);
  CHECK(fetch->copy == peer::LiveCopy{3, 2});  // its newest restorable copy, not (4, 0)
  // The next shard answers with epoch 3's newest copy, which this shard restores (its own newer
  // copies by lineage are dropped by the host as it takes it: ShardHost::TakeCopy).
  const std::string bytes = "epoch 3's copy";
  s.coordinator->OnMessage(
      0, peer::Message{0, 6, peer::ReplicaChunk{6, 1, served, true, 0, bytes.size(), peer::Blob(std::string(bytes))}});
  REQUIRE(s.host.restored_copies.size() == 1);
  CHECK(s.host.restored_copies.back() == served);
  REQUIRE(s.host.restore_done);
  s.host.restore_done(Status::Ok(), {});
  // Epoch 6 then serves (heard): (4, 0) is above every served epoch's lineage no more, yet it was
  // passed over by epoch 6's restore, and stays so. (A host that kept it: RecordingHost does.)
  s.coordinator->OnMessage(0, peer::Message{0, 6, ServedHeartbeat(s, 0, 6)});
  s.host.own_copies = {never, served};
  order(7);
  fetch = fetched(7);
  REQUIRE(fetch.has_value());
  CHECK(fetch->copy == served);
  // Nothing restorable of its own (only (4, 0), and epoch 3 served last): it asks for any copy,
  // and restores its own newest if the next shard keeps none.
  Shard t(1, 2);
  t.options.applies_on_arrival = true;
  t.coordinator = std::make_unique<ClusterCoordinator>(t.options, t.host, t.network, [&t] { return t.now; });
  t.coordinator->Start();
  t.coordinator->OnPeerUp(0);
  t.host.own_copies = {never};
  t.coordinator->OnMessage(0, peer::Message{0, 1, ServedHeartbeat(t, 0, 3)});
  t.coordinator->OnMessage(0, peer::Message{0, 6, peer::Restore{6, -1, {}, true, 0, /*newest=*/true}});
  std::optional<peer::ReplicaFetch> asked;
  for (const auto& [to, m] : t.network.sent) {
    if (const auto* f = std::get_if<peer::ReplicaFetch>(&m.body); f != nullptr && to == 0) asked = *f;
  }
  REQUIRE(asked.has_value());
  CHECK(asked->copy.step < 0);
  t.coordinator->OnMessage(0, peer::Message{0, 6, peer::ReplicaChunk{6, 1, asked->copy, true, 0, 0, {}}});
  REQUIRE(t.host.restored_copies.size() == 1);
  CHECK(t.host.restored_copies.back() == never);
}

namespace {

// A host whose stand-in, when stopped, leaves the copies of its predecessor's part it kept, and
// that records the copies it is given to keep.
class HandingBackHost : public CommitRecordingHost {
 public:
  void StartStandIn(int shard, std::vector<std::string>) override { stand_ins.push_back(shard); }
  StandInLeft StopStandIn() override {
    ++stopped;
    return left;
  }
  Status TakeCopy(int owner, const peer::LiveCopy& copy, std::shared_ptr<const std::string> bytes) override {
    taken.push_back({owner, copy, *bytes});
    return Status::Ok();
  }
  struct Taken {
    int owner;
    peer::LiveCopy copy;
    std::string bytes;
  };
  std::vector<int> stand_ins;
  int stopped = 0;
  StandInLeft left;
  std::vector<Taken> taken;
};

// The copies handed back to `to`: (owner, copy, bytes) per piece.
std::vector<std::tuple<int, peer::LiveCopy, std::string>> HandedBack(const RecordingNetwork& network, int to) {
  std::vector<std::tuple<int, peer::LiveCopy, std::string>> out;
  for (const auto& [shard, m] : network.sent) {
    const auto* chunk = std::get_if<peer::ReplicaChunk>(&m.body);
    if (chunk != nullptr && shard == to && chunk->hand_back) {
      out.emplace_back(chunk->owner, chunk->copy, std::string(chunk->data.data(), chunk->data.size()));
    }
  }
  return out;
}

}  // namespace

// A stand-in for shard 0 (run by shard 1) was also the next shard of shard 2's part: it kept
// copies of it. When shard 0's own process is back, the host stops the stand-in; those copies go
// to shard 0's own process, until it acknowledges them. (Simulation seed 1097754: they went with
// the stand-in, and shard 2's crash a moment later left no copy of its part.)
TEST_CASE("coordinator: a stand-in's host hands the copies it kept back to its shard's own process",
          "[cluster][takeover]") {
  HandingBackHost host;
  ClusterOptions options;
  options.me = 1;
  options.addresses = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
  options.heartbeat_ms = 20;
  options.election_timeout_ms = 200;
  options.replicate = true;
  options.takeover_after = std::chrono::milliseconds(100);
  RecordingNetwork network;
  Clock::time_point now = Clock::time_point{} + std::chrono::hours(1);
  ClusterCoordinator c(options, host, network, [&now] { return now; });
  host.held_copies = {{3, 4}};  // shard 0's part: what a stand-in would serve it from
  c.Start();
  c.OnPeerUp(0);
  c.OnPeerUp(2);
  auto hears = [&](int from) {
    peer::Heartbeat hb;
    hb.chief = 1;
    hb.ready = true;
    hb.address = options.addresses[static_cast<size_t>(from)];
    c.OnMessage(from, peer::Message{from, c.Describe().term, hb});
  };
  auto tick = [&] {
    now += std::chrono::milliseconds(20);
    c.Tick();
  };
  // Shard 0 is silent, shard 2 speaks: a stand-in for shard 0 starts.
  for (int t = 0; t < 20 && host.stand_ins.empty(); ++t) {
    hears(2);
    tick();
  }
  REQUIRE(host.stand_ins == std::vector<int>{0});
  host.left.held = {{{5, 8}, std::make_shared<peer::CopyBytes>(std::string("part 2 at step 8"))},
                    {{5, 7}, std::make_shared<peer::CopyBytes>(std::string("part 2 at step 7"))}};
  // Shard 0's own process is heard: the stand-in stops, and what it kept goes to shard 0.
  hears(0);
  CHECK(host.stopped == 1);
  using Piece = std::tuple<int, peer::LiveCopy, std::string>;
  CHECK(HandedBack(network, 0) == std::vector<Piece>{{2, {5, 8}, "part 2 at step 8"}, {2, {5, 7}, "part 2 at step 7"}});
  // Not acknowledged: sent again after an election timeout; each acknowledged one no more.
  c.OnMessage(0, peer::Message{0, c.Describe().term, peer::ReplicaAck{0, {5, 8}, false, /*hand_back=*/true}});
  // (An ordinary ack of that copy, or a hand-back's from another shard, is not this one's.)
  c.OnMessage(0, peer::Message{0, c.Describe().term, peer::ReplicaAck{0, {5, 7}}});
  c.OnMessage(2, peer::Message{2, c.Describe().term, peer::ReplicaAck{0, {5, 7}, false, /*hand_back=*/true}});
  for (int t = 0; t < 12; ++t) {
    hears(0);
    hears(2);
    tick();
  }
  auto sent = HandedBack(network, 0);
  CHECK(std::count(sent.begin(), sent.end(), Piece{2, {5, 8}, "part 2 at step 8"}) == 1);
  CHECK(std::count(sent.begin(), sent.end(), Piece{2, {5, 7}, "part 2 at step 7"}) == 2);
  // Not acknowledged at all: given up after kMaxHandBackSends.
  for (int t = 0; t < 12 * (ClusterCoordinator::kMaxHandBackSends + 2); ++t) {
    hears(0);
    hears(2);
    tick();
  }
  sent = HandedBack(network, 0);
  CHECK(std::count(sent.begin(), sent.end(), Piece{2, {5, 7}, "part 2 at step 7"}) ==
        ClusterCoordinator::kMaxHandBackSends);
}

// The side of shard 0's own process (here shard 1 of 3, its predecessor 0, its next shard 2): it
// keeps what the next shard hands back of its predecessor's part, unless a checkpoint's timeline
// left it here, and acknowledges either way. Only the next shard hands back, only that part.
TEST_CASE("coordinator: a shard keeps the copies of its predecessor's part handed back to it", "[cluster][takeover]") {
  HandingBackHost host;
  Follower f(host, /*replicate=*/true);
  auto hand_back = [&](int from, int owner, peer::LiveCopy copy, const std::string& bytes) {
    peer::ReplicaChunk chunk{7, owner, copy, false, 0, bytes.size(), peer::Blob(std::string(bytes)), true};
    f.c->OnMessage(from, peer::Message{from, 3, chunk});
  };
  auto acks = [&](peer::LiveCopy copy) {
    int n = 0;
    for (const auto& [to, m] : f.network.sent) {
      const auto* a = std::get_if<peer::ReplicaAck>(&m.body);
      if (to == 2 && a != nullptr && a->hand_back && a->copy == copy) ++n;
    }
    return n;
  };
  hand_back(2, 0, {2, 5}, "part 0 at step 5");
  REQUIRE(host.taken.size() == 1);
  CHECK(host.taken[0].owner == 0);
  CHECK(host.taken[0].copy == peer::LiveCopy{2, 5});
  CHECK(host.taken[0].bytes == "part 0 at step 5");
  CHECK(acks({2, 5}) == 1);
  // From the predecessor (it sends its own copies, not handed back), or a part other than the
  // predecessor's: not taken, not answered.
  hand_back(0, 0, {2, 6}, "part 0 at step 6");
  hand_back(2, 2, {2, 6}, "part 2 at step 6");
  CHECK(host.taken.size() == 1);
  CHECK(acks({2, 6}) == 0);
  // Epoch 3 restores empty (a new timeline): a copy of lineage 2 is acknowledged but not kept; one
  // of lineage 3 is kept.
  f.Restore();
  hand_back(2, 0, {2, 9}, "part 0 at step 9");
  CHECK(host.taken.size() == 1);
  CHECK(acks({2, 9}) == 1);
  hand_back(2, 0, {3, 1}, "part 0 at step 1");
  CHECK(host.taken.size() == 2);
  CHECK(acks({3, 1}) == 1);
}

// A restore order carries the chief's map: a shard whose heartbeats have not yet told it that the
// next shard is served by a stand-in (or back at home) fetches its copy from the process the chief
// formed with. (Async simulation seed 1234512: shard 3 fetched from a stand-in for shard 4 that
// was gone from the chief's map, got an older copy, and restored it over the newest one, which
// shard 4's own process kept.)
TEST_CASE("coordinator: a shard follows the chief's map of a restore order before it fetches its copy",
          "[cluster][takeover]") {
  CommitRecordingHost host;
  Follower f(host, /*replicate=*/true);
  const std::string stand_in = "127.0.0.1:903";
  REQUIRE(f.c->Addresses()[2] == f.options.addresses[2]);
  peer::Restore r{3, 5, {}, /*live=*/true, /*lineage=*/2, /*newest=*/false, {{2, stand_in}}};
  f.c->OnMessage(0, peer::Message{0, 3, r});
  CHECK(f.c->Addresses()[2] == stand_in);
  // Moved first, then asked (its own copy (2, 5) is not kept here).
  REQUIRE(f.network.retargets.size() == 1);
  CHECK(f.network.retargets[0].shard == 2);
  CHECK(f.network.retargets[0].address == stand_in);
  REQUIRE(f.network.Fetches(2, 3) == 1);
  size_t fetch_at = 0;
  while (!Is<peer::ReplicaFetch>(f.network.sent[fetch_at].second)) ++fetch_at;
  CHECK(f.network.retargets[0].after <= fetch_at);
  // The next order names no stand-in: shard 2 is looked for at home again.
  r.epoch = 4;
  r.moved.clear();
  f.c->OnMessage(0, peer::Message{0, 4, r});
  CHECK(f.c->Addresses()[2] == f.options.addresses[2]);
}

// Seed 935513 (3 shards, stand-ins, lane 300; it passes on its timings now): a chief fell back to
// checkpoint 4's timeline over step 2 (here: the new chief holds its part of step 4 on disk but
// missed the seal, which its peers wrote). Lacking the manifest, it skipped step 4 and formed at
// step 2, before a released step. Its peers' heartbeats carry their newest manifest: it keeps it
// (its own part is the one named) and seals step 4 here and everywhere with its order.
TEST_CASE("coordinator: a chief that missed a seal its peers hold keeps their manifest and forms there", "[cluster]") {
  auto part = [](int shard, uint64_t checksum) {
    return peer::PartInfo{shard, "part-" + std::to_string(shard), 100, checksum};
  };
  const std::vector<peer::PartInfo> four = {part(0, 40), part(1, 41), part(2, 42)};
  const std::vector<peer::PartInfo> two = {part(0, 20), part(1, 21), part(2, 22)};
  auto order = [&](std::optional<std::vector<peer::PartInfo>> told) {
    ShardHost::CheckpointScan scan;
    scan.sealed = {2};
    scan.unusable = {4};
    scan.seals = {{2, two}};
    scan.unsealed_parts = {{4, told && !told->empty() ? told->front() : part(0, 40)}};
    return ChiefOrderTo1(3, scan, [&](int, peer::Heartbeat* hb) {
      hb->sealed_steps = {4, 2};
      hb->seal_digests = {peer::SealDigest(four), peer::SealDigest(two)};
      if (told) hb->newest_seal = peer::Seal{0, 4, four};
    });
  };
  // Not told: step 2 (what the chief did).
  auto skipped = order(std::nullopt);
  REQUIRE(skipped.has_value());
  CHECK(skipped->step == 2);
  // Told: step 4, with the manifest for the shards that lack it (the chief itself restores with it).
  auto resealed = order(four);
  REQUIRE(resealed.has_value());
  CHECK(resealed->step == 4);
  CHECK(resealed->seal == four);
  // Its part on disk is another than the manifest names (another timeline's): not kept.
  auto other = order(std::vector<peer::PartInfo>{part(0, 99)});
  REQUIRE(other.has_value());
  CHECK(other->step == 2);
}
