#include "cluster_sim.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <unordered_map>
#include <utility>

#include "cluster/coordinator.h"
#include "cluster/peer_network.h"
#include "cluster/shard_host.h"

namespace psd::sim {

using server::ClusterCoordinator;
using server::ClusterOptions;
using server::PeerNetwork;
using server::ShardHost;
using server::StandInLeft;
using server::VarPlacement;
namespace peer = server::peer;

namespace {

constexpr uint64_t kEmptyValue = 0x9e3779b97f4a7c15ull;
constexpr int64_t kHeartbeatMs = 100;
constexpr int64_t kLinkCheckMs = 50;  // how often broken links try to reconnect

uint64_t Mix(uint64_t h, uint64_t v) {
  uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::string Describe(const peer::Message& m) {
  return std::visit(
      [&](const auto& b) -> std::string {
        using T = std::decay_t<decltype(b)>;
        std::string kind = peer::KindName(m.body);
        if constexpr (std::is_same_v<T, peer::Heartbeat>) {
          return fmt::format("{} term {} chief {} epoch {} running {} sealed [{}]", kind, m.term, b.chief, b.epoch,
                             b.running, fmt::join(b.sealed_steps, ","));
        } else if constexpr (std::is_same_v<T, peer::Prepared> || std::is_same_v<T, peer::Commit> ||
                             std::is_same_v<T, peer::Committed> || std::is_same_v<T, peer::Restore>) {
          return fmt::format("{} term {} epoch {} step {}", kind, m.term, b.epoch, b.step);
        } else if constexpr (std::is_same_v<T, peer::Restored>) {
          return fmt::format("{} term {} epoch {} step {} ok {}", kind, m.term, b.epoch, b.step, b.ok);
        } else if constexpr (std::is_same_v<T, peer::PartWritten> || std::is_same_v<T, peer::Seal>) {
          return fmt::format("{} term {} step {}", kind, m.term, b.step);
        } else if constexpr (std::is_same_v<T, peer::Control>) {
          return fmt::format("{} term {} job_done {} snapshot {}", kind, m.term, b.job_done, b.snapshot_step);
        } else {
          return fmt::format("{} term {}", kind, m.term);
        }
      },
      m.body);
}

class Sim;

// One shard's checkpoint directory for a step.
struct DiskEntry {
  bool has_part = false;
  uint64_t part_checksum = 0;  // = the engine's value at that step
  bool has_manifest = false;
  uint64_t manifest_checksum = 0;              // what the manifest records for this shard's part
  bool abandoned = false;                      // (the sim's note) an operator approved losing it
  std::vector<peer::PartInfo> manifest_parts;  // every shard's, as the manifest lists them
  bool restorable() const { return has_part && has_manifest && manifest_checksum == part_checksum; }
};

// A part as the simulated disk writes it: its checksum is the engine's value at that step.
peer::PartInfo SimPart(int shard, int64_t step, uint64_t value) {
  return {shard, "part-" + std::to_string(step), 64, value};
}

struct Engine {
  uint64_t epoch = 0;
  int64_t step = 0;
  uint64_t value = kEmptyValue;
  bool prepared = false;  // the open step is taken (staged), waiting for the commit
  bool closed = false;    // training is over
};

class FakeHost;
class Endpoint;

// A process speaking as a shard: the shard's own (proc = index) or, with takeover, its stand-in
// (proc = P + index), which runs inside the next shard's process (its host).
struct Shard {
  int index = 0;  // the shard it speaks as
  int proc = 0;   // its slot in Sim::shards_
  bool stand_in = false;
  int host_proc = -1;   // a stand-in's host: the next shard's process
  std::string address;  // where it serves: "shard-<i>:1", a stand-in "standin-<i>:<life>"
  uint64_t stand_ins_asked = 0, stand_ins_stopped = 0;  // a stand-in: its host's StartStandIn / StopStandIn
  bool up = false;
  bool exited = false;  // finished the job (a daemon with --exit-when-done; a stand-in that stopped by itself)
  uint64_t life = 0;    // bumped by every crash, restart and exit: stale events check it
  std::map<int64_t, DiskEntry> disk;
  uint64_t saved_term = 0;  // on disk too
  Engine engine;
  std::pair<uint64_t, int64_t> prepare_for{0, -1};  // the (epoch, step) a prepare is scheduled for
  int64_t restores_until = 0;                       // when the last queued restore completes
  bool writer_busy = false;
  std::optional<std::tuple<uint64_t, int64_t, uint64_t>> pending_snapshot;  // (epoch, step, value)
  std::map<peer::LiveCopy, uint64_t> own_copies, held_copies;               // replication (memory: lost by a crash)
  // Its links: where each shard's messages go (PeerNetwork::Retarget), and what waits for a link
  // being moved to a new address (sent once it is up).
  std::vector<std::string> targets;
  std::vector<bool> moving;
  std::vector<std::vector<peer::Message>> pending;
  std::unique_ptr<FakeHost> host;
  std::unique_ptr<Endpoint> net;
  std::unique_ptr<ClusterCoordinator> coord;
  int64_t lane_at = 0;  // SimOptions::lane_ms: when the batch handed to its lane last runs
};

// from's outgoing link to `to` (= to's incoming connection from `from`).
struct Link {
  bool connected = false;  // `to` has seen OnPeerUp(from)
  uint64_t gen = 0;        // bumped when it breaks: what was in flight is lost
  int64_t last_delivery = 0;
  int64_t down_until = 0;  // broken by a fault: no reconnect before
};

class Sim {
 public:
  explicit Sim(const SimOptions& o)
      : o_(o), rng_(o.seed), shards_(static_cast<size_t>(o.takeover ? 2 * o.shards : o.shards)) {
    const size_t procs = shards_.size();
    links_.assign(procs, std::vector<Link>(procs));
    group_.assign(static_cast<size_t>(o.shards), 0);
    for (size_t p = 0; p < procs; ++p) {
      Shard& sh = shards_[p];
      sh.proc = static_cast<int>(p);
      sh.index = sh.proc % o.shards;
      sh.stand_in = sh.proc >= o.shards;
      sh.host_proc = sh.stand_in ? (sh.index + 1) % o.shards : -1;
      sh.address = sh.stand_in ? "" : Entry(sh.index);
    }
  }

  SimResult Run();

  // --- used by the fakes ---
  int64_t now() const { return now_; }
  std::chrono::steady_clock::time_point clock() const {
    // Far from the clock's zero, like a real steady clock (a peer never heard from is not "recent").
    return std::chrono::steady_clock::time_point(std::chrono::milliseconds(now_ + 1000000000));
  }
  int64_t Uniform(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng_); }
  bool Chance(double p) { return p > 0 && std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  bool faulty() const { return now_ < o_.fault_ms; }
  void At(int64_t t, std::function<void()> fn) {
    queue_.push_back({t, seq_++, std::move(fn)});
    std::push_heap(queue_.begin(), queue_.end(), EventAfter());
  }
  // Runs `fn` later if shard `s` is still in the same life.
  void Later(int s, int64_t t, std::function<void(Shard&)> fn) {
    uint64_t life = shard(s).life;
    At(t, [this, s, life, fn = std::move(fn)] {
      Shard& sh = shard(s);
      if (sh.up && sh.life == life) fn(sh);
    });
  }
  void CountReseal() { ++result_.reseals; }
  void CountDelta() { ++result_.deltas; }
  void CountDeltaRefused() { ++result_.deltas_refused; }
  void Note(std::string line) {
    if (o_.trace) result_.trace.push_back(fmt::format("{:>7} ms  {}", now_, line));
  }
  bool tracing() const { return o_.trace; }
  void Fail(const std::string& why) {
    if (!result_.ok) return;
    result_.ok = false;
    result_.failure = fmt::format("at {} ms: {}\n{}", now_, why, State());
    Note("VIOLATION: " + why);
  }
  Shard& shard(int s) { return shards_[static_cast<size_t>(s)]; }
  int shards() const { return o_.shards; }
  static std::string Entry(int index) { return "shard-" + std::to_string(index) + ":1"; }
  std::string Name(int p) {
    const Shard& sh = shard(p);
    return (sh.stand_in ? "stand-in " : "shard ") + std::to_string(sh.index);
  }

  // From process `from` to whoever serves shard `to` there.
  void Send(int from, int to, const peer::Message& m);
  void Retarget(int from, int to, const std::string& address);
  // Takeover: the host `host` starts / stops its stand-in for shard `index`.
  void StartStandIn(int host, int index, std::vector<std::string> links);
  // Returns what the stand-in leaves (ClusterCoordinator::Leaving).
  StandInLeft StopStandIn(int host);
  // Observations from the fakes.
  void OnFormation(int chief, uint64_t epoch, int64_t step);
  void OnPublished(int s, uint64_t epoch, int64_t step, uint64_t value);
  void OnRestored(int s, uint64_t epoch, int64_t step, uint64_t value);
  void OnStartServing(int s);
  void OnRelease(int s, int64_t step);
  void OnWorkersDoneCheck(int s);
  void Exit(int s);
  void QueueSnapshot(int s, uint64_t epoch, int64_t step, uint64_t value);
  // A copy of `owner`'s state `copy` with `value` was kept (replication).
  void OnCopyKept(int keeper, int owner, const peer::LiveCopy& copy, uint64_t value);
  // Process `p` published (committed a step of) its shard's part in `epoch`: true if no other
  // process did (else the run fails). (A restore alone serves nothing: two chiefs may form one
  // term, the lower index winning before either serves, and the loser's restores stay idle.)
  bool ServesPart(int p, uint64_t epoch);
  // Every process that served a part of `epoch` (and so saved its term) lost its checkpoint
  // directory since; `kept` names one that did not.
  bool EveryDiskLostSince(uint64_t epoch, int* kept = nullptr) const {
    auto it = losses_at_serve_.find(epoch);
    if (it == losses_at_serve_.end()) return false;
    for (auto& [p, losses] : it->second) {
      if (disk_losses_[static_cast<size_t>(p)] != losses) continue;
      if (kept != nullptr) *kept = p;
      return false;
    }
    return true;
  }
  void OnLiveFormation() { ++result_.live_formations; }
  bool async() const { return o_.async; }
  // Async: process `p` applies push `id` (its engine's count goes up by one).
  void Apply(int p, uint64_t id);

 private:
  struct Event {
    int64_t t;
    uint64_t seq;
    std::function<void()> fn;
  };
  struct EventAfter {
    bool operator()(const Event& a, const Event& b) const { return a.t != b.t ? a.t > b.t : a.seq > b.seq; }
  };

  void StartShard(int s, std::vector<std::string> links = {});
  // Stops process `p` at once (a crash, or a stand-in its host stopped): links break, memory is lost.
  void Stop(int p);
  void Crash(int s);
  void ScheduleTick(int s);
  int GroupOf(int p) const {
    const Shard& sh = shards_[static_cast<size_t>(p)];
    return group_[static_cast<size_t>(sh.stand_in ? sh.host_proc : p)];
  }
  // The process at `address` (-1: none ever).
  int Resolve(const std::string& address) const {
    for (const Shard& sh : shards_) {
      if (sh.address == address) return sh.proc;
    }
    return -1;
  }
  bool AllExited() const {
    for (int i = 0; i < o_.shards; ++i) {
      if (!shards_[static_cast<size_t>(i)].exited) return false;
    }
    return true;
  }
  int StandInOf(int index) const { return o_.takeover ? o_.shards + index : -1; }
  // The stand-in an original process hosts (-1: none).
  int HostedBy(int p) const { return o_.takeover ? StandInOf((p + o_.shards - 1) % o_.shards) : -1; }
  bool Allowed(int from, int to) const;
  void Break(int from, int to, int64_t down_ms);
  void CheckLinks();
  void SchedulePrepares();
  void InjectFault();
  void StopFaults();
  // The operator: a chief that refuses to form (a shard lost checkpoints) is told to recover.
  void Operator();
  void StartWrite(int s);
  std::string State();
  // Async: the workers' next push, to every shard serving the running epoch.
  void Push();
  // Async: the pushes a state holds (its chain).
  std::set<uint64_t> PushesIn(uint64_t value) const;

  const SimOptions o_;
  std::mt19937_64 rng_;
  int64_t now_ = 0;
  uint64_t seq_ = 0;
  std::vector<Event> queue_;
  std::vector<Shard> shards_;
  std::vector<std::vector<Link>> links_;
  std::vector<int> group_;  // partition: shards talk only within their group
  SimResult result_;

  // What the invariants remember.
  std::map<uint64_t, int> server_of_epoch_;  // epoch -> the chief's process
  // (epoch, shard) -> the process (and its life) that published that part; the last to restore it.
  std::map<std::pair<uint64_t, int>, std::pair<int, uint64_t>> part_server_;
  std::map<std::pair<uint64_t, int>, int> restored_by_;
  std::map<uint64_t, std::set<int>> restorers_;  // epoch -> every process that restored a part of it (saved its term)
  std::map<uint64_t, int64_t> released_;         // epoch -> last step released
  std::map<std::pair<uint64_t, int64_t>, std::map<int, uint64_t>> published_;  // (epoch, step) -> shard -> value
  std::map<uint64_t, std::map<int, std::pair<int64_t, uint64_t>>> restored_;   // epoch -> shard -> (step, value)
  std::set<uint64_t> formed_;                                                  // epochs whose formation was checked
  std::set<uint64_t> reformed_;  // served epochs formed again, their records reset (until they serve again)
  bool workers_done_ = false;
  bool operator_approved_ = false;  // a state loss the next formation may make
  std::vector<int64_t> disk_losses_ = std::vector<int64_t>(shards_.size(), 0);  // per process (its directory)
  std::map<uint64_t, std::map<int, int64_t>> losses_at_serve_;  // epoch -> its processes' disk_losses_ when it served
  int64_t max_released_ = -1;                                   // the newest step released in any epoch
  int64_t serving_since_ = -1;                                  // single_faults: when the cluster last served
  // Async: the epoch that served last, the pushes sent so far, each state's (previous state,
  // push) and each part's pushes acknowledged.
  uint64_t serving_epoch_ = 0;
  uint64_t pushes_ = 0;
  std::unordered_map<uint64_t, std::pair<uint64_t, uint64_t>> chain_;
  std::vector<std::set<uint64_t>> acked_ = std::vector<std::set<uint64_t>>(static_cast<size_t>(o_.shards));
};

// Process `proc`'s network (it speaks as shard `me`).
class Endpoint : public PeerNetwork {
 public:
  Endpoint(Sim& sim, int proc, int me) : sim_(sim), proc_(proc), me_(me) {}
  void Send(int shard, const peer::Message& m) override {
    if (auto* r = std::get_if<peer::Restore>(&m.body); r != nullptr && shard == me_) {
      if (r->live) sim_.OnLiveFormation();
      sim_.OnFormation(proc_, r->epoch, r->step);
    }
    sim_.Send(proc_, shard, m);
  }
  void Retarget(int shard, const std::string& address) override { sim_.Retarget(proc_, shard, address); }

 private:
  Sim& sim_;
  const int proc_;
  const int me_;
};

// Process `proc`'s host (it serves shard `me`'s part).
class FakeHost : public ShardHost {
 public:
  FakeHost(Sim& sim, int proc, int me) : sim_(sim), proc_(proc), me_(me) {}
  Shard& sh() { return sim_.shard(proc_); }

  Status CommitStep(uint64_t epoch, int64_t step, bool checkpoint, double) override {
    Engine& e = sh().engine;
    if (sim_.async()) {
      sim_.Fail(fmt::format("{} was ordered to commit step {} (epoch {}) in async", sim_.Name(proc_), step, epoch));
      return Aborted("async");
    }
    if (e.epoch != epoch) return Aborted("another epoch");
    if (!e.prepared || e.step != step) {
      return FailedPrecondition(
          fmt::format("asked to commit step {} at step {} (prepared {})", step, e.step, e.prepared));
    }
    e.prepared = false;
    // The gradients of a step differ from one epoch to the next (workers re-pull and recompute).
    e.value = Mix(Mix(e.value, static_cast<uint64_t>(step)), epoch);
    e.step = step + 1;
    sim_.OnPublished(proc_, epoch, e.step, e.value);
    if (checkpoint) sim_.QueueSnapshot(proc_, e.epoch, e.step, e.value);
    return Status::Ok();
  }
  double learning_rate() override { return 0.01; }
  void PushTokens(int64_t step) override { sim_.OnRelease(proc_, step); }
  void StartServing(int) override { sim_.OnStartServing(proc_); }
  void SetRequired(int) override {}
  void FailWaiters(const Status&) override {}
  void ReportIfIdle() override {}
  // The simulated cluster runs sync without a step deadline: no shard ever votes a forced step,
  // so no chief may order one, and no async order (a snapshot between steps) may come either.
  void ForceStep(uint64_t epoch, int64_t step) override {
    sim_.Fail(
        fmt::format("{} was ordered to force step {} (epoch {}) with no step deadline", sim_.Name(proc_), step, epoch));
  }
  int64_t global_step() override {
    if (!sim_.async())
      sim_.Fail(fmt::format("{}: a sync coordinator asked for the async global step", sim_.Name(proc_)));
    return sh().engine.step;
  }
  Status SnapshotAs(uint64_t epoch, int64_t step) override {
    if (!sim_.async()) {
      sim_.Fail(fmt::format("{} was ordered an async snapshot at step {} (epoch {})", sim_.Name(proc_), step, epoch));
      return Aborted("sync");
    }
    const Engine& e = sh().engine;
    if (e.epoch != epoch) return Aborted("another epoch");
    sim_.Note(fmt::format("{}: snapshot for checkpoint step {} (at its count {})", sim_.Name(proc_), step, e.step));
    sim_.QueueSnapshot(proc_, epoch, step, e.value);
    return Status::Ok();
  }
  // Async: the chief's count goes on from the highest one restored.
  void RaiseGlobalStep(uint64_t epoch, int64_t step) override {
    Engine& e = sh().engine;
    if (!sim_.async() || e.epoch != epoch || step <= e.step) return;
    e.step = step;
    sim_.OnPublished(proc_, epoch, e.step, e.value);
  }
  // Async: a copy of the engine as it is now, a moment later.
  void KeepCopyNowAsync(uint64_t epoch, std::optional<peer::LiveCopy> base, CopyDone done) override {
    sim_.Later(proc_, sim_.now() + sim_.Uniform(0, 5), [this, epoch, base, done = std::move(done)](Shard& s) mutable {
      if (s.engine.epoch != epoch) return done(std::nullopt, nullptr);
      const peer::LiveCopy copy{epoch, s.engine.step};
      if (base && s.own_copies.count(*base) == 0) base.reset();
      s.own_copies[copy] = s.engine.value;
      Trim(&s.own_copies);
      done(copy, Serialize(s.engine.value, base));
    });
  }

  void RestoreAsync(uint64_t epoch, int64_t step, const std::vector<peer::PartInfo>& seal, RestoreDone done) override {
    Shard& s = sh();
    int64_t start = std::max(sim_.now(), s.restores_until);
    s.restores_until = start + sim_.Uniform(1, 80);
    sim_.Later(proc_, s.restores_until, [this, epoch, step, seal, done = std::move(done)](Shard& s) {
      if (!seal.empty()) {
        Status sealed = SealOwnPart(step, seal);
        if (!sealed.ok()) return done(sealed, {});
      }
      uint64_t value = kEmptyValue;
      if (step >= 0) {
        auto it = s.disk.find(step);
        if (it == s.disk.end() || !it->second.restorable()) {
          sim_.Note(fmt::format("{}: restore of step {} for epoch {} fails", sim_.Name(proc_), step, epoch));
          return done(NotFound("no restorable checkpoint at that step"), {});
        }
        value = it->second.part_checksum;
      }
      s.engine = Engine{epoch, std::max<int64_t>(step, 0), value, false, false};
      sim_.Note(fmt::format("{}: restored step {} for epoch {}", sim_.Name(proc_), step, epoch));
      sim_.OnRestored(proc_, epoch, step, value);
      VarPlacement p;
      p.name = "v" + std::to_string(me_);
      p.shape = {4};
      p.parts = {{me_, 0, 0}};
      done(Status::Ok(), {p});
    });
  }
  CheckpointScan ScanCheckpoints() override {
    CheckpointScan scan;
    for (auto it = sh().disk.rbegin(); it != sh().disk.rend(); ++it) {
      const DiskEntry& d = it->second;
      (d.restorable() ? scan.sealed : scan.unusable).push_back(it->first);
      if (d.restorable()) scan.seals[it->first] = d.manifest_parts;
      if (!d.restorable() && d.has_part) scan.unsealed_parts[it->first] = SimPart(me_, it->first, d.part_checksum);
    }
    return scan;
  }
  Status SealCheckpoint(int64_t step, const std::vector<peer::PartInfo>& parts) override {
    DiskEntry& d = sh().disk[step];
    d.has_manifest = true;
    d.manifest_parts = parts;
    d.manifest_checksum = 0;
    for (const auto& p : parts) {
      if (p.shard == me_) d.manifest_checksum = p.checksum;
    }
    sim_.Note(fmt::format("{}: sealed step {}{}", sim_.Name(proc_), step, d.restorable() ? "" : " (its part differs)"));
    if (d.has_part && !d.restorable()) {
      sim_.Fail(
          fmt::format("{} sealed checkpoint step {} with a manifest that does not match its part "
                      "(parts of two timelines mixed)",
                      sim_.Name(proc_), step));
    }
    return Status::Ok();
  }
  // A seal carried by a restore order: written only if this shard's part matches it.
  Status SealOwnPart(int64_t step, const std::vector<peer::PartInfo>& parts) {
    auto it = sh().disk.find(step);
    uint64_t want = 0;
    bool named = false;
    for (const auto& p : parts) {
      if (p.shard == me_) {
        want = p.checksum;
        named = true;
      }
    }
    if (it == sh().disk.end() || !it->second.has_part || !named || it->second.part_checksum != want) {
      sim_.Note(fmt::format("{}: refused the seal of step {} carried by a restore (its part differs)", sim_.Name(proc_),
                            step));
      return FailedPrecondition("this shard's part does not match the seal");
    }
    sim_.Note(fmt::format("{}: seals step {} from a restore order", sim_.Name(proc_), step));
    sim_.CountReseal();
    return SealCheckpoint(step, parts);
  }
  // --- replication: a copy is the engine's value, serialized with filler so it travels in pieces.
  void LiveCopies(std::vector<peer::LiveCopy>* own, std::vector<peer::LiveCopy>* held) override {
    own->clear();
    held->clear();
    for (auto it = sh().own_copies.rbegin(); it != sh().own_copies.rend(); ++it) own->push_back(it->first);
    for (auto it = sh().held_copies.rbegin(); it != sh().held_copies.rend(); ++it) held->push_back(it->first);
  }
  // In pieces, as the daemon's host gives its copies: the value, then two halves of 0-3000 bytes of
  // filler (a half of 1 KiB or more goes partly from its own memory: the chunks are 1 KiB). One
  // draw, as before the pieces: the regression seeds keep their schedules.
  // With `base`: a difference from that copy (as the daemon's host sends when it is smaller), which
  // the receiver takes only if it keeps `base` — it carries the whole value all the same.
  std::shared_ptr<const peer::CopyBytes> Serialize(uint64_t value, std::optional<peer::LiveCopy> base = std::nullopt) {
    const auto filler = static_cast<size_t>(sim_.Uniform(0, 3000));
    std::vector<peer::Blob> pieces;
    pieces.emplace_back(std::string(reinterpret_cast<const char*>(&value), sizeof(value)));
    if (base) {
      std::string delta(kDelta);
      delta.append(reinterpret_cast<const char*>(&base->lineage), sizeof(base->lineage));
      delta.append(reinterpret_cast<const char*>(&base->step), sizeof(base->step));
      pieces.emplace_back(std::move(delta));
    }
    pieces.emplace_back(std::string(filler / 2, 'x'));
    pieces.emplace_back(std::string(filler - filler / 2, 'y'));
    return std::make_shared<const peer::CopyBytes>(std::move(pieces));
  }
  void Trim(std::map<peer::LiveCopy, uint64_t>* copies) {
    while (copies->size() > 2) copies->erase(copies->begin());
    NoteCopies(*copies);
  }
  // The trace lists a shard's copies as they change.
  void NoteCopies(const std::map<peer::LiveCopy, uint64_t>& copies) {
    if (!sim_.tracing()) return;
    std::string list;
    for (auto& [c, v] : copies) list += fmt::format(" ({},{})", c.lineage, c.step);
    sim_.Note(fmt::format("{} {} copies:{}", sim_.Name(proc_), &copies == &sh().own_copies ? "own" : "held",
                          list.empty() ? std::string(" none") : list));
  }
  static constexpr std::string_view kDelta = "DELTA";
  std::shared_ptr<const peer::CopyBytes> KeepCopy(uint64_t epoch, const peer::LiveCopy& copy,
                                                  std::optional<peer::LiveCopy> base) override {
    const Engine& e = sh().engine;
    if (e.epoch != epoch) return nullptr;
    if (e.step != copy.step) {
      sim_.Fail(fmt::format("{} asked to keep a copy of step {} at step {}", sim_.Name(proc_), copy.step, e.step));
      return nullptr;
    }
    if (base && sh().own_copies.count(*base) == 0) base.reset();
    sh().own_copies[copy] = e.value;
    Trim(&sh().own_copies);
    return Serialize(e.value, base);
  }
  std::shared_ptr<const peer::CopyBytes> SerializedCopy(int owner, const peer::LiveCopy& copy) override {
    auto& copies = owner == me_ ? sh().own_copies : sh().held_copies;
    auto it = copies.find(copy);
    return it == copies.end() ? nullptr : Serialize(it->second);
  }
  Status TakeCopy(int owner, const peer::LiveCopy& copy, std::shared_ptr<const std::string> bytes) override {
    if (bytes->size() < sizeof(uint64_t)) return InvalidArgument("a copy too short");
    uint64_t value = 0;
    std::memcpy(&value, bytes->data(), sizeof(value));
    if (std::string_view(*bytes).substr(sizeof(value), kDelta.size()) == kDelta) {
      if (owner == me_) return InvalidArgument("a difference sent back for a restore");
      peer::LiveCopy base;
      if (bytes->size() < sizeof(value) + kDelta.size() + 16) return InvalidArgument("a difference too short");
      std::memcpy(&base.lineage, bytes->data() + sizeof(value) + kDelta.size(), 8);
      std::memcpy(&base.step, bytes->data() + sizeof(value) + kDelta.size() + 8, 8);
      if (sh().held_copies.count(base) == 0) {
        sim_.CountDeltaRefused();
        return FailedPrecondition("a difference from a copy not kept here");
      }
      sim_.CountDelta();
    }
    sim_.OnCopyKept(proc_, owner, copy, value);
    auto& copies = owner == me_ ? sh().own_copies : sh().held_copies;
    if (owner == me_) copies.erase(copies.upper_bound(copy), copies.end());  // (ShardHost::TakeCopy)
    copies[copy] = value;
    Trim(&copies);
    return Status::Ok();
  }
  void DropCopies(std::optional<peer::LiveCopy> newest, uint64_t epoch) override {
    for (auto* copies : {&sh().own_copies, &sh().held_copies}) {
      const size_t before = copies->size();
      auto [first, last] = server::LeftCopies(*copies, newest, epoch);
      copies->erase(first, last);
      if (copies->size() != before) NoteCopies(*copies);
    }
  }
  void RestoreCopyAsync(uint64_t epoch, const peer::LiveCopy& copy, RestoreDone done) override {
    Shard& s = sh();
    int64_t start = std::max(sim_.now(), s.restores_until);
    s.restores_until = start + sim_.Uniform(1, 80);
    sim_.Later(proc_, s.restores_until, [this, epoch, copy, done = std::move(done)](Shard& s) {
      auto it = s.own_copies.find(copy);
      if (it == s.own_copies.end()) return done(NotFound("no such copy"), {});
      s.engine = Engine{epoch, copy.step, it->second, false, false};
      sim_.Note(fmt::format("{}: restored the live copy of step {} for epoch {}", sim_.Name(proc_), copy.step, epoch));
      sim_.OnRestored(proc_, epoch, copy.step, it->second);
      VarPlacement p;
      p.name = "v" + std::to_string(me_);
      p.shape = {4};
      p.parts = {{me_, 0, 0}};
      done(Status::Ok(), {p});
    });
  }

  bool CheckpointWriterBusy() override { return sh().writer_busy || sh().pending_snapshot.has_value(); }
  uint64_t LoadTerm() override { return sh().saved_term; }
  void SaveTerm(uint64_t term) override { sh().saved_term = std::max(sh().saved_term, term); }
  bool EndTraining(int64_t snapshot_step) override {
    Engine& e = sh().engine;
    e.closed = true;
    if (sim_.async()) {  // the final part as it is, labelled with the chief's count
      if (snapshot_step < 0) return false;
      sim_.QueueSnapshot(proc_, e.epoch, snapshot_step, e.value);
      return true;
    }
    if (snapshot_step < 0 || e.prepared || e.step != snapshot_step) return false;
    sim_.QueueSnapshot(proc_, e.epoch, e.step, e.value);
    return true;
  }
  void FinishJob() override {
    sim_.Later(proc_, sim_.now(), [this](Shard&) { sim_.Exit(proc_); });
  }
  void EndJobIfDone() override { sim_.OnWorkersDoneCheck(proc_); }
  void StartStandIn(int shard, std::vector<std::string> links) override {
    sim_.StartStandIn(proc_, shard, std::move(links));
  }
  StandInLeft StopStandIn() override { return sim_.StopStandIn(proc_); }

 private:
  Sim& sim_;
  const int proc_;
  const int me_;
};

// --- the network --------------------------------------------------------------------------------

bool Sim::Allowed(int from, int to) const {
  const Shard& a = shards_[static_cast<size_t>(from)];
  const Shard& b = shards_[static_cast<size_t>(to)];
  const Link& l = links_[static_cast<size_t>(from)][static_cast<size_t>(to)];
  if (a.exited) return now_ <= l.last_delivery;  // what it sent before it exited still arrives
  return a.up && b.up && GroupOf(from) == GroupOf(to) && now_ >= l.down_until;
}

void Sim::Break(int from, int to, int64_t down_ms) {
  Link& l = links_[static_cast<size_t>(from)][static_cast<size_t>(to)];
  l.down_until = std::max(l.down_until, now_ + down_ms);
  if (!l.connected) return;
  l.connected = false;
  ++l.gen;
  l.last_delivery = now_;
  Shard& b = shard(to);
  Note(fmt::format("link {} -> {} breaks", Name(from), Name(to)));
  if (b.up) b.coord->OnPeerDown(shard(from).index);
}

void Sim::CheckLinks() {
  const int procs = static_cast<int>(shards_.size());
  for (int i = 0; i < procs; ++i) {
    Shard& a = shard(i);
    for (int j = 0; j < procs; ++j) {
      Shard& b = shard(j);
      if (a.index == b.index) continue;  // a stand-in and its shard's own process do not link
      Link& l = links_[static_cast<size_t>(i)][static_cast<size_t>(j)];
      // `a` dials whoever serves b's shard where it believes it is served.
      bool wanted = !a.targets.empty() && Resolve(a.targets[static_cast<size_t>(b.index)]) == j;
      bool allowed = wanted && Allowed(i, j);
      if (l.connected && !allowed) {
        Break(i, j, 0);
      } else if (!l.connected && allowed && !a.exited) {
        l.connected = true;
        ++l.gen;
        l.last_delivery = now_;
        Note(fmt::format("link {} -> {} up", Name(i), Name(j)));
        b.coord->OnPeerUp(a.index);
        if (a.moving[static_cast<size_t>(b.index)]) {
          // A link moved to a new address: what was given meanwhile goes now, in order.
          a.moving[static_cast<size_t>(b.index)] = false;
          std::vector<peer::Message> waiting;
          waiting.swap(a.pending[static_cast<size_t>(b.index)]);
          for (const auto& m : waiting) Send(i, b.index, m);
        }
      }
    }
  }
}

void Sim::Send(int from, int to_shard, const peer::Message& m) {
  if (to_shard < 0 || to_shard >= o_.shards) return;
  Shard& a = shard(from);
  if (to_shard == a.index) {  // posted to this process's own loop
    Later(from, now_ + Uniform(0, 1), [this, from, m](Shard& s) {
      if (tracing()) Note(fmt::format("{} -> self: {}", Name(from), Describe(m)));
      s.coord->OnMessage(s.index, m);
    });
    return;
  }
  const int to = Resolve(a.targets[static_cast<size_t>(to_shard)]);
  if (to < 0 || !links_[static_cast<size_t>(from)][static_cast<size_t>(to)].connected) {
    // A link that is down drops what it is given; one being moved keeps it for the new address.
    if (a.moving[static_cast<size_t>(to_shard)]) a.pending[static_cast<size_t>(to_shard)].push_back(m);
    return;
  }
  Link& l = links_[static_cast<size_t>(from)][static_cast<size_t>(to)];
  if (faulty() && Chance(o_.break_on_send)) {
    Note(fmt::format("{} -> {}: {} lost", Name(from), Name(to), Describe(m)));
    result_.faults.push_back(
        fmt::format("{} ms: link {} -> {} breaks at a {}", now_, Name(from), Name(to), peer::KindName(m.body)));
    return Break(from, to, Uniform(20, 600));
  }
  int64_t delay = faulty() && Chance(o_.slow) ? Uniform(100, 1500) : Uniform(1, 8);
  int64_t t = std::max(now_ + delay, l.last_delivery);
  if (o_.copy_ms > 0 && std::holds_alternative<peer::ReplicaChunk>(m.body)) t += Uniform(o_.copy_ms / 2, o_.copy_ms);
  l.last_delivery = t;
  int copies = faulty() && Chance(o_.duplicate) ? 2 : 1;
  uint64_t gen = l.gen;
  for (int c = 0; c < copies; ++c) {
    Later(to, t, [this, from, to, gen, m, c](Shard& s) {
      if (links_[static_cast<size_t>(from)][static_cast<size_t>(to)].gen != gen) return;  // the link broke
      if (tracing()) Note(fmt::format("{} -> {}: {}{}", Name(from), Name(to), Describe(m), c > 0 ? " (again)" : ""));
      s.coord->OnMessage(shard(from).index, m);
    });
  }
}

void Sim::Retarget(int from, int to_shard, const std::string& address) {
  Shard& a = shard(from);
  if (to_shard < 0 || to_shard >= o_.shards || to_shard == a.index) return;
  std::string& target = a.targets[static_cast<size_t>(to_shard)];
  if (target == address) return;
  Note(fmt::format("{}: the link to shard {} now goes to {} (was {})", Name(from), to_shard, address, target));
  const int old = Resolve(target);
  target = address;
  a.moving[static_cast<size_t>(to_shard)] = true;
  // The link to the old address closes (told from the event loop, not inside the coordinator's call).
  if (old >= 0) {
    uint64_t life = a.life;
    At(now_, [this, from, old, life] {
      if (shard(from).life == life && Resolve(shard(from).targets[static_cast<size_t>(shard(old).index)]) != old) {
        Break(from, old, 0);
      }
    });
  }
}

// --- shards ---------------------------------------------------------------------------------------

void Sim::StartShard(int s, std::vector<std::string> links) {
  Shard& sh = shard(s);
  if (sh.exited) {  // a stand-in that stopped by itself before: what it sent then is gone now
    for (int i = 0; i < static_cast<int>(shards_.size()); ++i) {
      if (i != s) Break(s, i, 0);
    }
  }
  sh.up = true;
  sh.exited = false;
  ++sh.life;
  sh.engine = Engine{};
  sh.prepare_for = {0, -1};
  sh.restores_until = 0;
  sh.writer_busy = false;
  sh.pending_snapshot.reset();
  sh.own_copies.clear();
  sh.held_copies.clear();
  if (sh.stand_in) sh.address = "standin-" + std::to_string(sh.index) + ":" + std::to_string(sh.life);
  sh.host = std::make_unique<FakeHost>(*this, s, sh.index);
  sh.net = std::make_unique<Endpoint>(*this, s, sh.index);
  ClusterOptions opt;
  opt.me = sh.index;
  for (int i = 0; i < o_.shards; ++i) opt.addresses.push_back(Entry(i));
  sh.targets = links.empty() ? opt.addresses : links;
  sh.moving.assign(static_cast<size_t>(o_.shards), false);
  sh.pending.assign(static_cast<size_t>(o_.shards), {});
  opt.links = std::move(links);
  opt.heartbeat_ms = kHeartbeatMs;
  opt.election_timeout_ms = 1000;
  opt.checkpoint_dir = "sim";
  opt.checkpoint_every_steps = o_.checkpoint_every;
  opt.keep_checkpoints = 0;  // the fake disk keeps everything
  opt.commit_timeout = std::chrono::milliseconds(2000);
  opt.formation_timeout = std::chrono::milliseconds(3000);
  opt.final_seal_timeout = std::chrono::milliseconds(1000);
  opt.replicate = o_.replicate;
  opt.applies_on_arrival = o_.async;
  opt.replica_chunk_bytes = 1024;  // several pieces per copy
  opt.stand_in = sh.stand_in;
  opt.incarnation = (static_cast<uint64_t>(s) + 1) << 32 | sh.life;  // a process of its own (no draw)
  if (o_.takeover && !sh.stand_in) opt.takeover_after = std::chrono::milliseconds(o_.takeover_after_ms);
  uint64_t life = sh.life;
  std::function<void(std::function<void()>)> lane;
  if (o_.lane_ms > 0) {
    // Later than decided, in order (events at one time run in the order they were queued): one
    // batch in thirty is a long one (a big commit or copy), and those after it wait.
    lane = [this, s](std::function<void()> batch) {
      Shard& at = shard(s);
      at.lane_at = std::max(at.lane_at, now_ + (Chance(0.03) ? Uniform(0, o_.lane_ms) : Uniform(0, 3)));
      Later(s, at.lane_at, [batch = std::move(batch)](Shard&) { batch(); });
    };
  }
  sh.coord = std::make_unique<ClusterCoordinator>(
      std::move(opt), *sh.host, *sh.net, [this] { return clock(); },
      [this, s, life] {
        At(now_, [this, s, life] {
          if (shard(s).up && shard(s).life == life) shard(s).coord->Tick();
        });
      },
      std::move(lane));
  if (sh.stand_in) sh.coord->SetAddress(sh.address);
  sh.coord->Start();
  ScheduleTick(s);
}

void Sim::ScheduleTick(int s) {
  Later(s, now_ + kHeartbeatMs, [this, s](Shard& sh) {
    sh.coord->Tick();
    ScheduleTick(s);
  });
}

void Sim::Stop(int p) {
  Shard& sh = shard(p);
  if (!sh.up) return;
  sh.coord->Stop();
  sh.up = false;
  ++sh.life;
  for (int i = 0; i < static_cast<int>(shards_.size()); ++i) {
    if (i == p) continue;
    Break(p, i, 0);
    Break(i, p, 0);
  }
  // Destroyed only now: the breaks above told the others, not this one.
  sh.coord.reset();
  sh.net.reset();
  sh.host.reset();
}

void Sim::Crash(int s) {
  // The stand-in it runs is in its process.
  if (int hosted = HostedBy(s); hosted >= 0) Stop(hosted);
  Stop(s);
}

void Sim::StartStandIn(int host, int index, std::vector<std::string> links) {
  const int p = StandInOf(index);
  if (p < 0 || shard(p).host_proc != host) {
    return Fail(fmt::format("{} started a stand-in for shard {}, not its predecessor", Name(host), index));
  }
  // It starts a moment later, once the last one (if any) has stopped, unless it was stopped
  // meanwhile (as the daemon's host does: StopStandIn covers the stand-ins asked for before).
  const uint64_t number = ++shard(p).stand_ins_asked;
  Later(host, now_ + Uniform(5, 60), [this, p, number, links = std::move(links)](Shard&) {
    if (shard(p).stand_ins_stopped >= number) return;
    if (shard(p).up) return Fail(fmt::format("{} started while one runs", Name(p)));
    ++result_.stand_ins;
    Note(fmt::format("{} starts on {}", Name(p), Name(shard(p).host_proc)));
    StartShard(p, links);
  });
}

StandInLeft Sim::StopStandIn(int host) {
  const int p = HostedBy(host);
  shard(p).stand_ins_stopped = shard(p).stand_ins_asked;
  StandInLeft kept;
  if (shard(p).up && shard(p).coord) kept = shard(p).coord->Leaving();
  Later(host, now_, [this, p](Shard&) {
    if (!shard(p).up) return;
    Note(fmt::format("{} is stopped by its host", Name(p)));
    Stop(p);
  });
  return kept;
}

void Sim::Exit(int s) {
  Shard& sh = shard(s);
  Note(fmt::format("{} exits (job finished)", Name(s)));
  sh.coord->Stop();
  sh.up = false;
  sh.exited = true;
  ++sh.life;
  for (int i = 0; i < static_cast<int>(shards_.size()); ++i) {
    if (i != s) Break(i, s, 0);  // its own links close once what it sent has arrived (CheckLinks)
  }
  if (sh.stand_in) {
    // It stopped by itself: its host may start another.
    Later(sh.host_proc, now_, [](Shard& host) { host.coord->OnStandInEnded(); });
    return;
  }
  if (int hosted = HostedBy(s); hosted >= 0) Stop(hosted);
  if (AllExited()) result_.end_ms = now_;
}

// --- the fake engines' work ------------------------------------------------------------------------

void Sim::SchedulePrepares() {
  if (workers_done_ || o_.async) return;
  for (auto& sh : shards_) {
    if (!sh.up || sh.engine.epoch == 0 || sh.engine.prepared || sh.engine.closed) continue;
    auto key = std::make_pair(sh.engine.epoch, sh.engine.step);
    if (sh.prepare_for == key) continue;
    auto r = released_.find(sh.engine.epoch);
    if (r == released_.end() || r->second < sh.engine.step) continue;  // no worker knows this step yet
    sh.prepare_for = key;
    int s = sh.proc;
    Later(s, now_ + Uniform(1, 30), [this, s, key](Shard& sh) {
      if (sh.engine.epoch != key.first || sh.engine.step != key.second || sh.engine.prepared || sh.engine.closed) {
        return;
      }
      sh.engine.prepared = true;
      Note(fmt::format("{}: prepared step {} (epoch {})", Name(s), key.second, key.first));
      sh.coord->OnPrepared(key.first, key.second, 1, 1, 1, false);
    });
  }
}

void Sim::QueueSnapshot(int s, uint64_t epoch, int64_t step, uint64_t value) {
  Shard& sh = shard(s);
  sh.pending_snapshot = {epoch, step, value};
  if (!sh.writer_busy) StartWrite(s);
}

void Sim::StartWrite(int s) {
  Shard& sh = shard(s);
  if (!sh.pending_snapshot) return;
  auto [epoch, step, value] = *sh.pending_snapshot;
  sh.pending_snapshot.reset();
  sh.writer_busy = true;
  Later(s, now_ + Uniform(5, 150), [this, s, epoch, step, value](Shard& sh) {
    DiskEntry& d = sh.disk[step];
    d.has_part = true;
    d.part_checksum = value;  // an older manifest of this step no longer matches it
    d.abandoned = false;
    sh.writer_busy = false;
    Note(fmt::format("{}: part of step {} written", Name(s), step));
    sh.coord->OnPartWritten(epoch, step, SimPart(sh.index, step, value));
    StartWrite(s);
  });
}

void Sim::Push() {
  if (workers_done_ || !o_.async) return;
  At(now_ + Uniform(3, 25), [this] { Push(); });
  if (serving_epoch_ == 0) return;
  const uint64_t id = ++pushes_;
  for (int k = 0; k < o_.shards; ++k) {
    auto by = restored_by_.find({serving_epoch_, k});
    if (by == restored_by_.end()) continue;
    const int p = by->second;
    const uint64_t epoch = serving_epoch_;
    // Each shard gets it after its own delay (so shards apply pushes in different orders).
    Later(p, now_ + Uniform(1, 12), [this, p, id, epoch](Shard& sh) {
      if (sh.engine.epoch != epoch || sh.engine.closed || !sh.coord->Serving().ok()) return;
      Apply(p, id);
    });
  }
}

void Sim::Apply(int p, uint64_t id) {
  Shard& sh = shard(p);
  Engine& e = sh.engine;
  const uint64_t before = e.value;
  e.value = Mix(before, id);
  chain_[e.value] = {before, id};
  ++e.step;
  OnPublished(p, e.epoch, e.step, e.value);
  const int k = sh.index;
  const uint64_t life = sh.life;
  sh.coord->AfterReplicated(e.epoch, [this, p, k, id, life](const Status& s) {
    if (!s.ok() || shard(p).life != life) return;
    acked_[static_cast<size_t>(k)].insert(id);
    ++result_.pushes_acked;
  });
  // The chief's count is the global step: the workers finish at the target.
  auto chief = server_of_epoch_.find(e.epoch);
  if (chief != server_of_epoch_.end() && chief->second == p && e.step >= o_.target_step && !workers_done_) {
    workers_done_ = true;
    Note("every worker finished");
    // Each worker's Finish reaches every shard it talks to (psclient::Client::Finish), and a shard
    // that is chief then ends the job: here that matters, as a chief deposed without knowing it
    // (cut off) may count the last pushes, and its job_done never reach the new chief.
    for (auto& other : shards_) {
      if (other.up) OnWorkersDoneCheck(other.proc);
    }
  }
}

std::set<uint64_t> Sim::PushesIn(uint64_t value) const {
  std::set<uint64_t> ids;
  for (auto it = chain_.find(value); it != chain_.end(); it = chain_.find(it->second.first)) {
    ids.insert(it->second.second);
  }
  return ids;
}

// --- invariants ------------------------------------------------------------------------------------

void Sim::OnFormation(int chief, uint64_t epoch, int64_t step) {
  // Two shards that claimed at once may both form the same term; the lower index wins before
  // either serves (OnStartServing checks that one chief runs each epoch).
  if (!formed_.insert(epoch).second) ++result_.contested;
  Note(fmt::format("{} forms epoch {} at step {}", Name(chief), epoch, step));
  // (Once per run of the term: two shards that claimed it at once both form it.)
  if (server_of_epoch_.count(epoch) > 0 && EveryDiskLostSince(epoch) && reformed_.insert(epoch).second) {
    // A term formed again (no directory that saved it is left; OnStartServing checks it): what
    // its last run restored and published is another timeline's, not what this one's copies are
    // compared with.
    for (auto p = published_.lower_bound({epoch, INT64_MIN}); p != published_.end() && p->first.first == epoch;) {
      p = published_.erase(p);
    }
    // (Async: the chief's count is raised, a publication, before it serves.)
    for (auto p = part_server_.lower_bound({epoch, INT_MIN}); p != part_server_.end() && p->first.first == epoch;) {
      p = part_server_.erase(p);
    }
    restored_.erase(epoch);
  }
  // Async: no step is released; what a formation must keep is the acknowledged pushes, checked
  // when it serves (OnStartServing).
  if (o_.async) return;
  if (step < max_released_) {
    ++result_.rollbacks;
    if (o_.replicate && o_.single_faults) {
      return Fail(
          fmt::format("epoch {} forms at step {}, before step {} whose tokens were released (one "
                      "fault at a time: a live copy of every part was left)",
                      epoch, step, max_released_));
    }
  }
  if (operator_approved_) {
    // What it loses was approved: the newer checkpoints are given up for good.
    operator_approved_ = false;
    for (auto& sh : shards_) {
      for (auto it = sh.disk.upper_bound(step); it != sh.disk.end(); ++it) it->second.abandoned = true;
    }
    return;
  }
  // The newest checkpoint every shard holds sealed: no formation may go back before it. (A shard
  // served by a stand-in counts a step only if the stand-in holds it too: a stand-in restores
  // from its own directory, and only a live copy carries what its shard's disk holds.)
  int64_t durable = -1;
  std::set<int64_t> common;
  bool first = true;
  for (int i = 0; i < o_.shards; ++i) {
    const Shard& sh = shard(i);
    if (sh.exited) return;
    std::set<int64_t> mine;
    for (auto& [t, d] : sh.disk) {
      if (d.restorable() && !d.abandoned) mine.insert(t);
    }
    if (int p = StandInOf(i); p >= 0 && shard(p).up) {
      for (auto it = mine.begin(); it != mine.end();) {
        auto theirs = shard(p).disk.find(*it);
        bool held = theirs != shard(p).disk.end() && theirs->second.restorable() && !theirs->second.abandoned;
        it = held ? std::next(it) : mine.erase(it);
      }
    }
    if (first) {
      common = mine;
      first = false;
    } else {
      std::set<int64_t> both;
      std::set_intersection(common.begin(), common.end(), mine.begin(), mine.end(), std::inserter(both, both.begin()));
      common.swap(both);
    }
  }
  // (Whole only if every manifest of the step lists the same parts: with stand-ins, a shard's own
  // process and its stand-in may each have sealed a step of their own timeline.)
  auto parts_of = [](std::vector<peer::PartInfo> v) {
    std::vector<std::pair<int, uint64_t>> out;
    for (const auto& p : v) out.emplace_back(p.shard, p.checksum);
    std::sort(out.begin(), out.end());
    return out;
  };
  for (auto it = common.begin(); it != common.end();) {
    bool same = true;
    std::optional<std::vector<std::pair<int, uint64_t>>> first_parts;
    for (const Shard& sh : shards_) {
      if (sh.stand_in && !sh.up) continue;
      auto d = sh.disk.find(*it);
      if (d == sh.disk.end() || !d->second.restorable()) continue;
      auto parts = parts_of(d->second.manifest_parts);
      if (!first_parts) first_parts = parts;
      same = same && parts == *first_parts;
    }
    // With takeover, a checkpoint of a step whose tokens never went out may be given up by a
    // formation through a stand-in (its directory lacks it; the live copies are of the step
    // before): that step is computed again, nothing released is lost.
    if (o_.takeover && *it > max_released_) same = false;
    it = same ? std::next(it) : common.erase(it);
  }
  if (!common.empty()) durable = *common.rbegin();
  if (step < durable) {
    Fail(fmt::format("{} forms epoch {} at step {}, before checkpoint {} that every shard holds sealed", Name(chief),
                     epoch, step, durable));
  }
}

bool Sim::ServesPart(int p, uint64_t epoch) {
  const int index = shard(p).index;
  const std::pair<int, uint64_t> mine{p, shard(p).life};
  auto [it, fresh] = part_server_.emplace(std::make_pair(epoch, index), mine);
  if (fresh || it->second == mine) return true;
  Fail(
      fmt::format("{} published shard {}'s part in epoch {}, which {} served{}: two primaries of one part in one "
                  "epoch",
                  Name(p), index, epoch, Name(it->second.first),
                  shard(it->second.first).life == it->second.second ? "" : " (and is gone)"));
  return false;
}

void Sim::OnPublished(int p, uint64_t epoch, int64_t step, uint64_t value) {
  const int s = shard(p).index;
  Note(fmt::format("{}: published step {} (epoch {})", Name(p), step, epoch));
  if (!ServesPart(p, epoch)) return;
  auto& m = published_[{epoch, step}];
  for (auto& [other, v] : m) {
    if (v != value && !o_.async) {  // (async: each shard applies pushes in its own order, from its own count)
      return Fail(
          fmt::format("shards {} and {} published different values at step {} of epoch {}", other, s, step, epoch));
    }
  }
  m[s] = value;
}

void Sim::OnRestored(int p, uint64_t epoch, int64_t step, uint64_t value) {
  restored_[epoch][shard(p).index] = {step, value};
  restored_by_[{epoch, shard(p).index}] = p;
  restorers_[epoch].insert(p);
}

void Sim::OnStartServing(int s) {
  const Engine& e = shard(s).engine;
  uint64_t epoch = e.epoch;
  Note(fmt::format("{} serves epoch {} from step {}", Name(s), epoch, e.step));
  serving_since_ = now_;
  reformed_.erase(epoch);
  auto [it, fresh] = server_of_epoch_.emplace(epoch, s);
  if (!fresh) {
    // Only a cluster with no disk left that remembers the term may form it again.
    int kept = -1;
    if (!EveryDiskLostSince(epoch, &kept)) {
      return Fail(
          fmt::format("{} and {} both ran epoch {} as chief ({}, which served it, still has its checkpoint "
                      "directory)",
                      Name(it->second), Name(s), epoch, Name(kept)));
    }
    Note(fmt::format("epoch {} formed again: every process that served it lost its checkpoint directory since", epoch));
    it->second = s;  // (what its last run published was forgotten at its formation: OnFormation)
  }
  auto& losses = losses_at_serve_[epoch];
  losses.clear();
  for (int p : restorers_[epoch]) losses[p] = disk_losses_[static_cast<size_t>(p)];
  bool stand_in = false;
  for (int i = 0; i < o_.shards; ++i) {
    auto by = restored_by_.find({epoch, i});
    stand_in = stand_in || (by != restored_by_.end() && shard(by->second).stand_in);
  }
  if (stand_in) ++result_.stand_in_serves;
  auto& r = restored_[epoch];
  if (static_cast<int>(r.size()) != o_.shards) {
    return Fail(fmt::format("{} serves epoch {} with {} of {} shards restored", Name(s), epoch, r.size(), o_.shards));
  }
  if (o_.async) {
    serving_epoch_ = epoch;
    // Every push a shard acknowledged is in the state its part restored (several faults at once
    // may lose some: counted, and forgotten).
    for (auto& [k, sv] : r) {
      std::set<uint64_t> held = PushesIn(sv.second);
      auto& acked = acked_[static_cast<size_t>(k)];
      for (auto it = acked.begin(); it != acked.end();) {
        if (held.count(*it) > 0) {
          ++it;
          continue;
        }
        if (o_.single_faults || o_.crash_rate <= 0) {
          return Fail(
              fmt::format("epoch {} serves shard {}'s part without push {}, which that shard acknowledged "
                          "({}: a copy holding it was left)",
                          epoch, k, *it, o_.single_faults ? "one fault at a time" : "no process crashed"));
        }
        ++result_.acked_lost;
        it = acked.erase(it);
      }
    }
    released_[epoch] = e.step;
    ++result_.formations;
    return;
  }
  for (auto& [other, sv] : r) {
    if (sv != r.begin()->second) {
      return Fail(fmt::format("epoch {}: shards {} and {} restored different states (steps {} and {})", epoch,
                              r.begin()->first, other, r.begin()->second.first, sv.first));
    }
  }
  released_[epoch] = e.step;
  ++result_.formations;
}

void Sim::OnCopyKept(int keeper, int owner, const peer::LiveCopy& copy, uint64_t value) {
  Note(fmt::format("{} keeps shard {}'s copy of step {} (lineage {})", Name(keeper), owner, copy.step, copy.lineage));
  // A copy is of the epoch that committed (or restored) that step: bit-identical to its owner's.
  std::optional<uint64_t> want;
  if (auto p = published_.find({copy.lineage, copy.step}); p != published_.end()) {
    if (auto v = p->second.find(owner); v != p->second.end()) want = v->second;
  }
  if (auto r = restored_.find(copy.lineage); !want && r != restored_.end()) {
    if (auto v = r->second.find(owner); v != r->second.end() && v->second.first == copy.step) want = v->second.second;
    if (auto v = r->second.find(owner); v != r->second.end() && v->second.first < 0 && copy.step == 0) {
      want = v->second.second;
    }
  }
  if (!want) {
    return Fail(fmt::format("{} keeps a copy of shard {} at step {} (lineage {}) that shard never published",
                            Name(keeper), owner, copy.step, copy.lineage));
  }
  if (*want != value) {
    return Fail(fmt::format("{}'s copy of shard {} at step {} (lineage {}) differs from what it published",
                            Name(keeper), owner, copy.step, copy.lineage));
  }
  ++result_.copies_checked;
}

void Sim::OnRelease(int s, int64_t step) {
  uint64_t epoch = shard(s).engine.epoch;
  Note(fmt::format("{} releases the tokens of step {} (epoch {})", Name(s), step, epoch));
  auto server = server_of_epoch_.find(epoch);
  if (server == server_of_epoch_.end() || server->second != s) {
    return Fail(fmt::format("{} releases step {} of epoch {} that it does not run", Name(s), step, epoch));
  }
  int64_t& last = released_[epoch];
  if (step != last + 1) {
    return Fail(fmt::format("epoch {}: the tokens of step {} released after step {}", epoch, step, last));
  }
  last = step;
  max_released_ = std::max(max_released_, step);
  auto& m = published_[{epoch, step}];
  if (static_cast<int>(m.size()) != o_.shards) {
    return Fail(
        fmt::format("epoch {}: step {} released with {} of {} shards published", epoch, step, m.size(), o_.shards));
  }
  ++result_.commits;
  if (step >= o_.target_step && !workers_done_) {
    workers_done_ = true;
    Note("every worker finished");
    OnWorkersDoneCheck(s);
  }
}

void Sim::OnWorkersDoneCheck(int s) {
  if (!workers_done_) return;
  Later(s, now_, [](Shard& sh) { sh.coord->OnJobDone(); });
}

// --- faults ------------------------------------------------------------------------------------------

void Sim::InjectFault() {
  if (!faulty()) return;
  double total = o_.crash_rate + o_.partition_rate + o_.break_rate;
  if (total <= 0) return;
  // The next one after an exponential wait.
  int64_t wait = static_cast<int64_t>(std::exponential_distribution<double>(total)(rng_) * 1000) + 1;
  At(now_ + wait, [this, total] {
    if (!faulty()) return;
    double pick = std::uniform_real_distribution<double>(0, total)(rng_);
    std::vector<int> live;  // shards' own processes (a stand-in dies with its host)
    for (int i = 0; i < o_.shards; ++i) {
      if (shard(i).up) live.push_back(i);
    }
    if (pick < o_.crash_rate) {
      // One fault at a time: only a cluster that has served a while loses a shard.
      bool whole = static_cast<int>(live.size()) == o_.shards &&
                   std::all_of(group_.begin(), group_.end(), [&](int g) { return g == group_[0]; });
      bool serving = true;
      for (int i = 0; i < o_.shards; ++i) serving = serving && shard(i).up && shard(i).coord->Serving().ok();
      // (Nor once the workers are done: a shard back after the others exited waits for them, a
      // liveness matter the general sweep covers, not what this mode checks.)
      if (o_.single_faults &&
          (!whole || !serving || workers_done_ || serving_since_ < 0 || now_ - serving_since_ < 1500)) {
        // skipped
      } else if (!live.empty()) {
        serving_since_ = -1;
        int s = live[static_cast<size_t>(Uniform(0, static_cast<int64_t>(live.size()) - 1))];
        int64_t down = Uniform(100, o_.max_down_ms);
        bool lose = !o_.single_faults && Chance(o_.lose_disk);
        result_.faults.push_back(fmt::format("{} ms: shard {} crashes for {} ms{}", now_, s, down,
                                             lose ? ", losing its checkpoint directory" : ""));
        Note(result_.faults.back());
        Crash(s);
        if (lose) {
          shard(s).disk.clear();
          shard(s).saved_term = 0;
          if (int hosted = HostedBy(s); hosted >= 0) {  // its stand-in's directory is beside its own
            shard(hosted).disk.clear();
            shard(hosted).saved_term = 0;
            ++disk_losses_[static_cast<size_t>(hosted)];
          }
          ++disk_losses_[static_cast<size_t>(s)];
        }
        At(now_ + down, [this, s] {
          if (!shard(s).up && !shard(s).exited && faulty()) {
            Note(fmt::format("shard {} restarts", s));
            StartShard(s);
          }
        });
      }
    } else if (pick < o_.crash_rate + o_.partition_rate) {
      std::vector<int> groups(static_cast<size_t>(o_.shards));
      std::string text;
      for (int i = 0; i < o_.shards; ++i) {
        groups[static_cast<size_t>(i)] = static_cast<int>(Uniform(0, 1));
        text += std::to_string(groups[static_cast<size_t>(i)]);
      }
      int64_t heal = Uniform(100, 3000);
      result_.faults.push_back(fmt::format("{} ms: partition {} for {} ms", now_, text, heal));
      Note(result_.faults.back());
      group_ = groups;
      At(now_ + heal, [this, groups] {
        if (group_ == groups) group_.assign(static_cast<size_t>(o_.shards), 0);
      });
    } else {
      int from = static_cast<int>(Uniform(0, o_.shards - 1));
      int to = static_cast<int>(Uniform(0, o_.shards - 2));
      if (to >= from) ++to;
      int64_t down = Uniform(20, 1500);
      result_.faults.push_back(fmt::format("{} ms: link {} -> {} down for {} ms", now_, from, to, down));
      Note(result_.faults.back());
      Break(from, to, down);
    }
    InjectFault();
  });
}

void Sim::StopFaults() {
  Note("faults stop: every shard up, no partition");
  group_.assign(static_cast<size_t>(o_.shards), 0);
  for (auto& row : links_) {
    for (auto& l : row) l.down_until = 0;
  }
  for (int i = 0; i < o_.shards; ++i) {
    if (!shard(i).up && !shard(i).exited) {
      Note(fmt::format("shard {} restarts", i));
      StartShard(i);
    }
  }
}

void Sim::Operator() {
  for (auto& sh : shards_) {
    if (!sh.up) continue;
    auto v = sh.coord->Describe();
    if (v.chief != sh.index || v.state.rfind("refusing to form", 0) != 0) continue;
    // Asked only when some shard really lacks (holds no trace of) a checkpoint another can restore.
    // (A loss approved before is asked again once shards that still hold the step restarted: the
    // decision is not kept on disk.)
    // (A stand-in counts while it runs: it restores from its own directory.)
    auto counts = [this](const Shard& x) { return !x.stand_in || x.up; };
    bool lacking = false;
    for (auto& a : shards_) {
      if (!counts(a)) continue;
      for (auto& [t, d] : a.disk) {
        if (!d.restorable()) continue;
        for (auto& b : shards_) lacking = lacking || (counts(b) && b.disk.count(t) == 0);
      }
    }
    if (!lacking)
      return Fail(Name(sh.proc) + " asks an operator to give up a checkpoint that every shard holds: " + v.state);
    // psd_admin recover: the newest step every shard can restore, else empty.
    Status s = sh.coord->Recover(-1, false);
    bool empty = !s.ok();
    if (empty) s = sh.coord->Recover(-1, true);
    if (!s.ok()) continue;
    operator_approved_ = true;
    result_.faults.push_back(
        fmt::format("{} ms: operator: recover{} on {}", now_, empty ? " --empty" : "", Name(sh.proc)));
    Note(result_.faults.back());
  }
  At(now_ + 500, [this] { Operator(); });
}

std::string Sim::State() {
  std::string out;
  for (auto& sh : shards_) {
    if (sh.stand_in && sh.life == 0) continue;  // never started
    std::string disk;
    for (auto& [t, d] : sh.disk) disk += fmt::format(" {}{}", t, d.restorable() ? "" : "?");
    out += fmt::format("  {}: {}", Name(sh.proc), sh.exited ? "exited" : sh.up ? "up" : "down");
    if (sh.stand_in) out += " at " + sh.address;
    if (sh.up) {
      auto v = sh.coord->Describe();
      out += fmt::format(", chief {} term {} epoch {} state '{}'", v.chief, v.term, v.epoch, v.state);
      out += fmt::format(", engine epoch {} step {}{}", sh.engine.epoch, sh.engine.step,
                         sh.engine.prepared ? " (prepared)" : "");
    }
    out += fmt::format(", disk [{} ]\n", disk);
  }
  return out;
}

SimResult Sim::Run() {
  for (int s = 0; s < o_.shards; ++s) {
    // Shards start within one heartbeat of each other.
    At(Uniform(0, kHeartbeatMs), [this, s] { StartShard(s); });
  }
  std::function<void()> links = [this, &links] {
    CheckLinks();
    At(now_ + kLinkCheckMs, links);
  };
  At(0, links);
  At(500, [this] { Operator(); });
  if (o_.async) At(0, [this] { Push(); });
  InjectFault();
  At(o_.fault_ms, [this] { StopFaults(); });
  const int64_t deadline = o_.fault_ms + o_.settle_ms;
  while (!queue_.empty() && result_.ok) {
    std::pop_heap(queue_.begin(), queue_.end(), EventAfter());
    Event e = std::move(queue_.back());
    queue_.pop_back();
    now_ = e.t;
    if (now_ > deadline) break;
    e.fn();
    ++result_.events;
    SchedulePrepares();
    if (AllExited()) break;
  }
  if (result_.ok) {
    bool all = AllExited();
    if (!all) {
      now_ = deadline;
      Fail(fmt::format("the job did not finish within {} ms after the faults stopped ({} steps released in all)",
                       o_.settle_ms, result_.commits));
    }
  }
  queue_.clear();
  for (auto& sh : shards_) {
    if (sh.coord) sh.coord->Stop();
  }
  return result_;
}

}  // namespace

SimResult RunSimulation(const SimOptions& options) {
  Sim sim(options);
  return sim.Run();
}

std::string Describe(const SimOptions& o, const SimResult& r, size_t max_trace_lines) {
  std::string out = fmt::format(
      "cluster simulation: seed {} shards {} fault_ms {} target_step {} lane_ms {} copy_ms {} -> {}\n", o.seed,
      o.shards, o.fault_ms, o.target_step, o.lane_ms, o.copy_ms, r.ok ? std::string("ok") : "FAILED " + r.failure);
  out += fmt::format("faults ({}):\n", r.faults.size());
  for (auto& f : r.faults) out += "  " + f + "\n";
  if (!r.trace.empty()) {
    size_t from = r.trace.size() > max_trace_lines ? r.trace.size() - max_trace_lines : 0;
    out += fmt::format("events ({} of {}, the last ones):\n", r.trace.size() - from, r.trace.size());
    for (size_t i = from; i < r.trace.size(); ++i) out += "  " + r.trace[i] + "\n";
  }
  return out;
}

}  // namespace psd::sim
