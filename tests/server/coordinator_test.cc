// One ClusterCoordinator (server/cluster/coordinator.h) driven by hand: a manual clock, a host
// that records what it is asked, a network that records what is sent. For orders of events the
// fault simulation (cluster_sim_test.cc) may not hit, such as a stand-in's start: the stand-in
// hears of the chief from the next shard's heartbeat before the chief links to it (the chief only
// does once it has heard the stand-in), and the chief's restore order comes right behind its
// link. (Found by the integration test "takeover with soft sync", under load: the stand-in
// counted the chief gone at its first tick, dropped the restore order, and the formation waited.)
#include "cluster/coordinator.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <string>
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
  void ScanCheckpoints(std::vector<int64_t>*, std::vector<int64_t>*,
                       std::map<int64_t, std::vector<peer::PartInfo>>*) override {}
  Status SealCheckpoint(int64_t, const std::vector<peer::PartInfo>&) override { return Status::Ok(); }
  Status SnapshotAs(uint64_t, int64_t) override { return Status::Ok(); }
  bool CheckpointWriterBusy() override { return false; }
  uint64_t LoadTerm() override { return 0; }
  void SaveTerm(uint64_t) override {}
  void LiveCopies(std::vector<peer::LiveCopy>* own, std::vector<peer::LiveCopy>* held) override {
    own->clear();
    held->clear();
  }
  std::shared_ptr<const std::string> KeepCopy(uint64_t, const peer::LiveCopy&) override { return nullptr; }
  std::shared_ptr<const std::string> SerializedCopy(int, const peer::LiveCopy&) override { return nullptr; }
  Status TakeCopy(int, const peer::LiveCopy&, std::shared_ptr<const std::string>) override { return Status::Ok(); }
  void DropCopies(std::optional<peer::LiveCopy>) override {}
  void RestoreCopyAsync(uint64_t epoch, const peer::LiveCopy&, RestoreDone) override { restores.push_back(epoch); }
  bool EndTraining(int64_t) override { return false; }
  void FinishJob() override {}
  void EndJobIfDone() override {}

  std::vector<uint64_t> restores;  // epochs a restore was started for
};

class RecordingNetwork : public PeerNetwork {
 public:
  void Send(int shard, const peer::Message& m) override { sent.push_back({shard, m}); }
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
