#include "cluster/coordinator.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <iterator>
#include <random>
#include <type_traits>
#include <utility>
#include <variant>

#include "cluster/election.h"

namespace psd::server {

namespace {

uint64_t RandomIncarnation() {
  std::random_device device;
  uint64_t id = 0;
  while (id == 0) id = (static_cast<uint64_t>(device()) << 32) | device();
  return id;
}

}  // namespace

ClusterCoordinator::ClusterCoordinator(ClusterOptions options, ShardHost& host, PeerNetwork& network,
                                       std::function<Clock::time_point()> now, std::function<void()> wake,
                                       std::function<void(std::function<void()>)> lane)
    : options_(std::move(options)),
      host_(host),
      network_(network),
      now_(std::move(now)),
      wake_(std::move(wake)),
      lane_(std::move(lane)),
      me_(options_.me),
      incarnation_(options_.incarnation != 0 ? options_.incarnation : RandomIncarnation()),
      shards_(options_.shards()),
      started_(now_()),
      peers_(static_cast<size_t>(shards_)),
      placement_(shards_, options_.slice_bytes) {
  MutexLock lock(&mu_);
  addresses_ = options_.links.size() == options_.addresses.size() ? options_.links : options_.addresses;
  address_ = options_.addresses[static_cast<size_t>(me_)];
  addresses_[static_cast<size_t>(me_)] = address_;
}

void ClusterCoordinator::Start() {
  ShardHost::CheckpointScan scan;
  if (!options_.checkpoint_dir.empty() && options_.restore) scan = host_.ScanCheckpoints();
  const uint64_t saved_term = host_.LoadTerm();
  {
    MutexLock lock(&mu_);
    // Terms (and so epochs) go on from the last one this shard knew, even if every shard restarts;
    // its heartbeats say so, and a chief's order at a term not above it is refused (a shard that
    // lost its checkpoint directory, and so its saved term, learns it from the others).
    term_ = std::max(term_, saved_term);
    max_term_seen_ = std::max(max_term_seen_, saved_term);
    saved_term_ = saved_term;
    sealed_ = scan.sealed;
    unusable_ = scan.unusable;
    seal_parts_ = std::move(scan.seals);
    unsealed_parts_ = std::move(scan.unsealed_parts);
    ready_ = true;
    missing_since_ = now_();
    missing_reason_ = "electing a chief";
  }
  spdlog::info("shard {} of {}: {} restorable checkpoint(s){}", me_, shards_, scan.sealed.size(),
               scan.sealed.empty() ? "" : fmt::format(", newest at step {}", scan.sealed.front()));
}

void ClusterCoordinator::Stop() {
  MutexLock lock(&mu_);
  stopped_ = true;
}

// --- sending ----------------------------------------------------------------------------------

peer::Message ClusterCoordinator::MessageLocked(peer::Body body) const {
  return peer::Message{me_, term_, std::move(body), incarnation_};
}

peer::Message ClusterCoordinator::ReplyLocked(peer::Body body) const {
  peer::Message msg = MessageLocked(std::move(body));
  msg.to = restore_leader_;
  return msg;
}

void ClusterCoordinator::SendTo(int shard, const peer::Message& msg) {
  if (shard < 0 || shard >= shards_) return;
  network_.Send(shard, msg);
}

void ClusterCoordinator::SendToAll(const peer::Message& msg, bool include_self) {
  network_.SendToAll(msg, include_self, shards_, me_);
}

peer::Message ClusterCoordinator::HeartbeatLocked() const {
  peer::Heartbeat hb;
  hb.chief = chief_;
  hb.epoch = epoch_;
  hb.running = chief_ == me_ && running_;
  hb.sealed_steps.assign(
      sealed_.begin(), sealed_.begin() + static_cast<std::ptrdiff_t>(std::min(sealed_.size(), peer::kMaxListedSteps)));
  for (int64_t t : hb.sealed_steps) {
    auto seal = seal_parts_.find(t);
    hb.seal_digests.push_back(seal == seal_parts_.end() ? 0 : peer::SealDigest(seal->second));
  }
  if (!sealed_.empty()) {
    if (auto seal = seal_parts_.find(sealed_.front()); seal != seal_parts_.end()) {
      hb.newest_seal = peer::Seal{0, seal->first, seal->second};
    }
  }
  hb.ready = ready_;
  hb.required = required_;
  hb.allow_state_loss = options_.allow_state_loss || !options_.restore;
  // The newest (unusable_ is not kept in order: steps found later are appended).
  hb.unusable_steps = unusable_;
  std::sort(hb.unusable_steps.begin(), hb.unusable_steps.end(), std::greater<>());
  if (hb.unusable_steps.size() > peer::kMaxListedSteps) hb.unusable_steps.resize(peer::kMaxListedSteps);
  // The parts of the newest unusable steps (a seal is only ever offered for a recent one).
  for (int64_t t : hb.unusable_steps) {
    if (hb.unsealed_parts.size() >= kMaxUnsealedParts) break;
    if (auto it = unsealed_parts_.find(t); it != unsealed_parts_.end()) hb.unsealed_parts.emplace(t, it->second);
  }
  hb.own_copies = own_copies_;
  hb.held_copies = held_copies_;
  hb.released = known_released_;
  hb.kept_copies = newest_heard_;  // (async/ssp replicas only; else empty)
  hb.served_parts = served_;       // (likewise)
  hb.listening = now_() - started_ < std::chrono::milliseconds(options_.election_timeout_ms);
  hb.address = address_;
  hb.stand_in = options_.stand_in;
  if (chief_ == me_) hb.moved = MovedLocked();
  // Followers show the chief's refusal as their own reason (workers may ask any shard).
  if (chief_ == me_ && !refusal_.empty() && missing_reason_ == refusal_) hb.waiting = refusal_;
  return MessageLocked(std::move(hb));
}

// --- state queries ----------------------------------------------------------------------------

bool ClusterCoordinator::AliveLocked(int shard, Clock::time_point now) const {
  if (shard == me_) return true;
  const Peer& p = peers_[static_cast<size_t>(shard)];
  return p.connections > 0 && now - p.last_heard < std::chrono::milliseconds(options_.election_timeout_ms);
}

bool ClusterCoordinator::ChiefGoneLocked(Clock::time_point now) const {
  // A shard may hear of the chief first from another shard's heartbeat (a stand-in, which the
  // chief links to only once it has heard the stand-in): counting the chief gone before its link
  // could have come would depose it, and drop its restore order, for nothing.
  // Its heartbeats (or the pieces of a copy it sends: OnMessage), from the process that serves it:
  // a stand-in left speaking as the chief's shard (in an older term) must not keep a chief alive
  // that no longer says so.
  const auto timeout = std::chrono::milliseconds(options_.election_timeout_ms);
  return (!AliveLocked(chief_, now) || now - chief_heard_ >= timeout) && now - chief_since_ >= timeout;
}

std::vector<int> ClusterCoordinator::MissingLocked(Clock::time_point now) const {
  std::vector<int> missing;
  for (int i = 0; i < shards_; ++i) {
    if (!AliveLocked(i, now)) missing.push_back(i);
  }
  return missing;
}

Status ClusterCoordinator::Serving() const {
  MutexLock lock(&mu_);
  auto now = now_();
  bool ok = chief_ == me_ ? running_ : (serving_ && chief_ >= 0 && AliveLocked(chief_, now));
  if (ok) return Status::Ok();
  double secs = std::chrono::duration<double>(now - missing_since_).count();
  std::string why = missing_reason_.empty() ? std::string("the cluster is forming") : missing_reason_;
  return Unavailable("shard " + std::to_string(me_) + ": not serving: " + why + " (for " + fmt::format("{:.1f}", secs) +
                     " s); retry");
}

bool ClusterCoordinator::is_chief() const {
  MutexLock lock(&mu_);
  return chief_ == me_;
}

int ClusterCoordinator::chief() const {
  MutexLock lock(&mu_);
  return chief_;
}

uint64_t ClusterCoordinator::epoch() const {
  MutexLock lock(&mu_);
  return epoch_;
}

ClusterCoordinator::View ClusterCoordinator::Describe() const {
  MutexLock lock(&mu_);
  View v;
  v.chief = chief_;
  v.term = term_;
  v.epoch = epoch_;
  v.missing = MissingLocked(now_());
  bool ok = chief_ == me_ ? running_ : (serving_ && chief_ >= 0);
  v.state = ok ? "running" : (missing_reason_.empty() ? "forming" : missing_reason_);
  return v;
}

// --- the heartbeat tick: election and the chief's duties --------------------------------------

void ClusterCoordinator::Tick() {
  std::vector<Action> actions;
  peer::Message hb;
  const bool writer_busy = host_.CheckpointWriterBusy();  // asked before locking (the host's lock)
  const int64_t applied = options_.applies_on_arrival ? host_.global_step() : 0;
  std::vector<peer::LiveCopy> own, held;
  if (options_.replicate) host_.LiveCopies(&own, &held);
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    writer_busy_ = writer_busy;
    applied_ = applied;
    if (options_.replicate) {
      own_copies_ = std::move(own);
      held_copies_ = std::move(held);
      HearCopiesLocked(me_, {});
    }
    TickLocked(&actions);
    NoteServedLocked();
    hb = HeartbeatLocked();
    ToLaneLocked(&actions);
  }
  SendToAll(hb, /*include_self=*/false);
  RunActions(&actions);
}

void ClusterCoordinator::ToLaneLocked(std::vector<Action>* actions) {
  if (!lane_ || actions->empty()) return;
  lane_([batch = std::exchange(*actions, {})]() mutable { RunActions(&batch); });
}

void ClusterCoordinator::RunActions(std::vector<Action>* actions) {
  for (auto& a : *actions) a();
  actions->clear();
}

void ClusterCoordinator::DegradeLocked(const std::string& why, std::vector<Action>* actions) {
  if (missing_reason_ != why) {
    missing_reason_ = why;
    missing_since_ = now_();
  }
  if (chief_ == me_ && running_) {
    running_ = false;
    spdlog::warn("cluster: {}; workers are told to wait, and the cluster re-forms {}", why,
                 options_.replicate ? "from the shards' live copies as soon as it can (a lost shard's part from the "
                                      "copy the next shard keeps), or from its last checkpoint"
                                    : "from its last checkpoint once every shard is back");
    actions->push_back(
        [this, why] { host_.FailWaiters(Unavailable("the cluster stopped serving: " + why + "; retry")); });
  }
  serving_ = false;
}

void ClusterCoordinator::TickLocked(std::vector<Action>* actions) {
  auto now = now_();
  if (job_done_) {  // the shards are winding down: no elections, no formations
    FinalSealTickLocked(now, actions);
    return;
  }
  // Election.
  if (chief_ != me_ && (chief_ < 0 || ChiefGoneLocked(now))) {
    if (chief_ >= 0) {
      spdlog::warn("cluster: chief shard {} ({}) is gone (term {})", chief_, AddressOf(chief_), term_);
      DegradeLocked("chief shard " + std::to_string(chief_) + " (" + AddressOf(chief_) + ") is missing", actions);
      chief_ = -1;
      vote_to_ = -1;  // what it was sent may be lost: vote again once a chief is known
    }
    if (now - started_ >= std::chrono::milliseconds(options_.election_timeout_ms)) {
      std::vector<bool> alive(static_cast<size_t>(shards_));
      // A shard that restarted lately listens before it may claim: it does not hold back the
      // claims of shards up for long (a chief lost just after a restart of a lower-index shard).
      // Shards started together (a cluster's start) all count, so the lowest index claims.
      const bool settled = now - started_ >= 2 * std::chrono::milliseconds(options_.election_timeout_ms);
      for (int i = 0; i < shards_; ++i) {
        alive[static_cast<size_t>(i)] =
            AliveLocked(i, now) && (i == me_ || !settled || !peers_[static_cast<size_t>(i)].listening);
      }
      if (election::Candidate(alive, me_) == me_) {
        term_ = std::max(term_, max_term_seen_) + 1;
        max_term_seen_ = term_;
        SaveTermLocked(actions);
        chief_ = me_;
        leader_ = incarnation_;
        chief_since_ = now;
        running_ = false;
        forming_ = false;
        required_ = local_required_;
        auto missing = MissingLocked(now);
        std::string list;
        for (int m : missing) list += (list.empty() ? "" : ", ") + std::to_string(m) + " (" + AddressOf(m) + ")";
        spdlog::info("cluster: shard {} is the chief for term {}{}", me_, term_,
                     missing.empty() ? "" : "; missing shard(s): " + list);
        // The job may have ended under the last chief without every shard hearing it.
        actions->push_back([this] { host_.EndJobIfDone(); });
      }
    }
  }
  if (options_.replicate) {
    ReplicationTickLocked(now, actions);
    TakeoverTickLocked(now, actions);
  }
  if (chief_ != me_) {
    if (options_.replicate) FollowerMapLocked(now, actions);
    ResendVoteLocked(actions);
    return;
  }
  // The chief's duties.
  if (options_.replicate) ChiefMapLocked(now, actions);
  auto missing = MissingLocked(now);
  if (!missing.empty()) {
    std::string list;
    for (int m : missing) list += (list.empty() ? "" : ", ") + std::to_string(m) + " (" + AddressOf(m) + ")";
    DegradeLocked("waiting for shard " + list, actions);
    if (forming_) {
      forming_ = false;
      spdlog::warn("cluster: formation at epoch {} abandoned: shard {} is missing", term_, list);
    }
    return;
  }
  if (options_.replicate && StandInServesLocked() && !MajorityLocked(now)) {
    // A stand-in serves a part, and this side of a partition may not be the only one serving.
    if (forming_) {
      forming_ = false;
      spdlog::warn(
          "cluster: formation at epoch {} abandoned: a stand-in serves a part, and this shard no longer "
          "hears a majority of the shards' own processes",
          term_);
    }
    DegradeLocked(
        "a stand-in serves a part, and the chief hears the own processes of no majority of the shards "
        "(a partition?)",
        actions);
    return;
  }
  if (running_) {
    if (options_.applies_on_arrival) return ArrivalCheckpointLocked(applied_, actions);
    if (commit_in_flight_ >= 0 && now - commit_start_ > options_.commit_timeout) {
      DegradeLocked("step " + std::to_string(commit_in_flight_) + " did not commit on every shard", actions);
    }
    return;
  }
  if (forming_) {
    if (now - formation_start_ > options_.formation_timeout) {
      forming_ = false;
      spdlog::warn("cluster: formation at epoch {} took too long; starting again", term_);
    }
    return;
  }
  for (int i = 0; i < shards_; ++i) {
    if (i != me_ && !peers_[static_cast<size_t>(i)].ready) return;  // still scanning checkpoints
  }
  StartFormationLocked(actions);
}

// --- messages ---------------------------------------------------------------------------------

void ClusterCoordinator::OnPeerUp(int shard) {
  if (shard < 0 || shard >= shards_ || shard == me_) return;
  MutexLock lock(&mu_);
  Peer& p = peers_[static_cast<size_t>(shard)];
  ++p.connections;
  p.last_heard = now_();
}

void ClusterCoordinator::OnPeerDown(int shard) {
  if (shard < 0 || shard >= shards_ || shard == me_) return;
  {
    MutexLock lock(&mu_);
    Peer& p = peers_[static_cast<size_t>(shard)];
    if (--p.connections > 0) return;
    p.connections = 0;
    p.ready = false;
    if (shard == Successor()) acked_.reset();  // it may come back without the copies it kept
    // A copy it was sending in pieces will not be finished on this link (a new sending starts at
    // its first piece): the pieces so far go, rather than up to a whole part held until then.
    std::erase_if(incoming_, [&](const auto& in) {
      const auto& [owner, restore, hand_back] = in.first;
      return restore || hand_back ? shard == Successor() : owner == shard;
    });
    if (stopped_) return;
    spdlog::warn("cluster: lost the link from shard {} ({})", shard, AddressOf(shard));
  }
  // React now rather than at the next tick: failover time is what operators wait for.
  if (wake_) wake_();
}

void ClusterCoordinator::BecomeFollowerLocked(std::vector<Action>* actions) {
  if (chief_ == me_) return;
  if (running_ || forming_) {
    running_ = false;
    forming_ = false;
    actions->push_back([this] { host_.FailWaiters(Unavailable("this shard is no longer the chief; retry")); });
  }
}

bool ClusterCoordinator::AcceptChiefLocked(int from, uint64_t sender, uint64_t term, std::vector<Action>* actions) {
  max_term_seen_ = std::max(max_term_seen_, term);
  election::View after;
  bool accept = election::AcceptChiefMessage({term_, chief_, leader_}, from, sender, term, &after);
  AdoptViewLocked(after, actions);
  if (accept) return true;
  spdlog::debug(
      "cluster: ignored a chief message from shard {} (process {:x}) at term {} (term {} chief {} process {:x})", from,
      sender, term, term_, chief_, leader_);
  return false;
}

void ClusterCoordinator::AdoptViewLocked(const election::View& after, std::vector<Action>* actions) {
  leader_ = after.leader;
  if (after.term == term_ && after.chief == chief_) return;
  term_ = after.term;
  if (after.chief != chief_) chief_since_ = now_();
  chief_ = after.chief;
  BecomeFollowerLocked(actions);
  SaveTermLocked(actions);
}

void ClusterCoordinator::OnMessage(int from, const peer::Message& msg) {
  if (from < 0 || from >= shards_) return;
  uint64_t term = msg.term;
  std::vector<Action> actions;
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    if (from != me_) peers_[static_cast<size_t>(from)].last_heard = now_();
    // The chief's life (ChiefGoneLocked): its heartbeats of this term (HandleHeartbeat), and the
    // pieces of a copy it sends in this epoch, or for the restore it ordered (a live copy this shard
    // fetches from it), which only the process serving its shard now sends. A large copy (hundreds
    // of MiB) queued ahead of a heartbeat on the link, or still being taken here, can hold the
    // heartbeat back longer than an election timeout while the chief is alive.
    if (const auto* chunk = std::get_if<peer::ReplicaChunk>(&msg.body);
        chunk != nullptr && from != me_ && FromLeaderLocked(from, msg.sender, term) &&
        ((epoch_ != 0 && chunk->epoch == epoch_) || (restore_epoch_ != 0 && chunk->epoch == restore_epoch_))) {
      chief_heard_ = now_();
    }
    // An answer about an epoch that another process of this shard's index ordered (a stand-in's,
    // or this shard's own process's before a takeover): not to this process's orders.
    const bool answer =
        std::holds_alternative<peer::Prepared>(msg.body) || std::holds_alternative<peer::Committed>(msg.body) ||
        std::holds_alternative<peer::Restored>(msg.body) || std::holds_alternative<peer::PartWritten>(msg.body);
    if (answer && msg.to != 0 && msg.to != incarnation_) {
      spdlog::debug("cluster: ignored a {} from shard {}: it answers process {:x} of this shard's index",
                    peer::KindName(msg.body), from, msg.to);
      return;
    }
    std::visit(
        [&](const auto& body) {
          mu_.AssertHeld();  // held by the caller: the analysis does not follow into the lambda
          using T = std::decay_t<decltype(body)>;
          if constexpr (std::is_same_v<T, peer::Heartbeat>) {
            HandleHeartbeat(from, term, msg.sender, body, &actions);
          } else if constexpr (std::is_same_v<T, peer::Prepared>) {
            HandlePrepared(from, term, body, &actions);
          } else if constexpr (std::is_same_v<T, peer::Commit>) {
            HandleCommit(from, term, msg.sender, body, &actions);
          } else if constexpr (std::is_same_v<T, peer::Committed>) {
            HandleCommitted(from, term, body, &actions);
          } else if constexpr (std::is_same_v<T, peer::Restore>) {
            HandleRestore(from, term, msg.sender, body, &actions);
          } else if constexpr (std::is_same_v<T, peer::Restored>) {
            HandleRestored(from, term, body, &actions);
          } else if constexpr (std::is_same_v<T, peer::PartWritten>) {
            HandlePartWritten(from, term, body, &actions);
          } else if constexpr (std::is_same_v<T, peer::Seal>) {
            HandleSeal(from, term, msg.sender, body, &actions);
          } else if constexpr (std::is_same_v<T, peer::Control>) {
            HandleControl(from, term, msg.sender, body, &actions);
          } else if constexpr (std::is_same_v<T, peer::CheckpointRequest>) {
            HandleCheckpointRequest(from, term, body, &actions);
          } else if constexpr (std::is_same_v<T, peer::ReplicaChunk>) {
            HandleReplicaChunk(from, body, &actions);
          } else if constexpr (std::is_same_v<T, peer::ReplicaAck>) {
            HandleReplicaAck(from, body, &actions);
          } else {
            HandleReplicaFetch(from, body, &actions);
          }
        },
        msg.body);
    ToLaneLocked(&actions);
  }
  RunActions(&actions);
}

void ClusterCoordinator::HandlePrepared(int from, uint64_t term, const peer::Prepared& p,
                                        std::vector<Action>* actions) {
  if (chief_ != me_ || term != term_ || p.epoch != term_ || !(running_ || forming_)) return;
  // The open step's votes, or the next one's from a shard that published this commit first: a vote
  // for any other step is never counted (and would stay until the next formation).
  if (p.step < open_step_ || p.step > open_step_ + 1) return;
  votes_[p.step][from] = {p.takes, p.min_gradients, p.max_gradients, p.forced};
  if (p.forced && running_ && p.step == open_step_ && forced_step_ < p.step) {
    // The step deadline passed on `from`: every shard takes the step with what it has.
    forced_step_ = p.step;
    peer::Message msg = MessageLocked(peer::Control{epoch_, false, -1, p.step});
    actions->push_back([this, msg] { SendToAll(msg, /*include_self=*/true); });
  }
  MaybeCommitLocked(actions);
}

void ClusterCoordinator::HandleCommitted(int from, uint64_t term, const peer::Committed& c,
                                         std::vector<Action>* actions) {
  if (chief_ != me_ || term != term_ || c.epoch != term_ || !running_) return;
  if (commit_in_flight_ < 0 || c.step != commit_in_flight_ + 1) return;
  committed_.insert(from);
  if (static_cast<int>(committed_.size()) < shards_) return;
  int64_t step = commit_in_flight_ + 1;
  auto& votes = votes_[commit_in_flight_];
  int min = INT32_MAX, max = 0;
  for (auto& [shard, v] : votes) {
    if (v.takes == 0) continue;
    min = std::min(min, v.min_gradients);
    max = std::max(max, v.max_gradients);
  }
  votes_.erase(votes_.begin(), votes_.upper_bound(commit_in_flight_));
  commit_in_flight_ = -1;
  open_step_ = step;
  released_ = step;
  KnowReleasedLocked(term_, step);
  actions->push_back([this, step, min, max] {
    host_.PushTokens(step);
    spdlog::debug("cluster: step {} committed on every shard ({}..{} gradients per variable)", step, min, max);
  });
  MaybeCommitLocked(actions);
}

void ClusterCoordinator::HandleCheckpointRequest(int, uint64_t, const peer::CheckpointRequest&, std::vector<Action>*) {
  if (chief_ == me_) checkpoint_next_ = true;
}

void ClusterCoordinator::HandleHeartbeat(int from, uint64_t term, uint64_t sender, const peer::Heartbeat& hb,
                                         std::vector<Action>* actions) {
  Peer& p = peers_[static_cast<size_t>(from)];
  // Takeover: its own process and a stand-in may both speak as `from`. Only the one it is served
  // by now tells its state (its copies, checkpoints, readiness, claims); the other is only heard,
  // for the chief's map (ChiefMapLocked) and a stand-in's host (TakeoverHeartbeatLocked).
  const bool served =
      hb.stand_in ? hb.address == AddressOf(from) : AddressOf(from) == options_.addresses[static_cast<size_t>(from)];
  const Clock::time_point heard = now_();
  if (hb.stand_in) {
    p.stand_in_heard = heard;
    p.stand_in_address = hb.address;
  } else {
    p.original_heard = heard;
  }
  if (!served) {
    max_term_seen_ = std::max(max_term_seen_, term);
    if (options_.replicate) TakeoverHeartbeatLocked(from, term, sender, hb, /*served=*/false, actions);
    return;
  }
  p.term = term;
  p.epoch = hb.epoch;
  p.ready = hb.ready;
  p.sealed = hb.sealed_steps;
  p.seal_digests = hb.seal_digests.size() == hb.sealed_steps.size() ? hb.seal_digests : std::vector<uint64_t>{};
  p.unusable = hb.unusable_steps;
  p.unsealed_parts = hb.unsealed_parts;
  HearSealLocked(from, hb.newest_seal);
  p.allow_state_loss = hb.allow_state_loss;
  p.own_copies = hb.own_copies;
  p.held_copies = hb.held_copies;
  HearCopiesLocked(from, hb.kept_copies);
  HearServedLocked(hb.served_parts);
  KnowReleasedLocked(hb.released.lineage, hb.released.step);
  p.listening = hb.listening;
  p.last_heartbeat = heard;
  max_term_seen_ = std::max(max_term_seen_, term);
  election::View after = election::OnClaim({term_, chief_, leader_}, term, hb.chief, shards_, from, sender);
  const bool newer = after.term > term_;
  AdoptViewLocked(after, actions);
  if (newer && chief_ != me_ && chief_ >= 0) spdlog::info("cluster: shard {} is the chief (term {})", chief_, term_);
  if (FromLeaderLocked(from, sender, term)) {
    chief_heard_ = heard;
    bool was = serving_;
    serving_ = hb.running && hb.epoch == epoch_ && epoch_ != 0;
    if (serving_ && !was) {
      missing_reason_.clear();
      live_failed_.clear();  // (see HandleRestored)
    }
    if (!hb.running && missing_reason_.empty()) {
      missing_reason_ = "the chief (shard " + std::to_string(from) + ") is forming the cluster";
      missing_since_ = now_();
    }
    if (!hb.waiting.empty() && !serving_ && missing_reason_ != hb.waiting) {
      missing_reason_ = hb.waiting;
      missing_since_ = now_();
    }
    int required = hb.required;
    if (required > 0 && required != required_) {
      required_ = required;
      actions->push_back([this, required] { host_.SetRequired(required); });
    }
  }
  if (options_.replicate) TakeoverHeartbeatLocked(from, term, sender, hb, /*served=*/true, actions);
  NoteServedLocked();  // (with the chief's map just heard)
}

void ClusterCoordinator::MaybeCommitLocked(std::vector<Action>* actions) {
  if (chief_ != me_ || !running_ || commit_in_flight_ >= 0) return;
  auto it = votes_.find(open_step_);
  if (it == votes_.end() || static_cast<int>(it->second.size()) < shards_) return;
  // Every shard holding a trainable part must have taken something: an idle report from a shard
  // whose part is placed but not yet created (or not yet taken) does not count. Placement comes
  // before creation, so no step can close under a variable being created.
  int takes = 0;
  std::vector<bool> training = placement_.TrainingShards();
  for (auto& [shard, v] : it->second) {
    if (training[static_cast<size_t>(shard)] && v.takes == 0) return;
    takes += v.takes;
  }
  if (takes == 0) return;  // no shard has anything to train yet
  commit_in_flight_ = open_step_;
  commit_start_ = now_();
  committed_.clear();
  bool checkpoint = !options_.checkpoint_dir.empty() &&
                    (checkpoint_next_ ||
                     (options_.checkpoint_every_steps > 0 && (open_step_ + 1) % options_.checkpoint_every_steps == 0));
  checkpoint_next_ = false;
  peer::Commit c{term_, open_step_, checkpoint, 0.0};
  peer::Message msg = MessageLocked(c);
  actions->push_back([this, msg]() mutable {
    std::get<peer::Commit>(msg.body).learning_rate = host_.learning_rate();
    SendToAll(msg, /*include_self=*/true);
  });
}

void ClusterCoordinator::HandleCommit(int from, uint64_t term, uint64_t sender, const peer::Commit& c,
                                      std::vector<Action>* actions) {
  if (!AcceptChiefLocked(from, sender, term, actions) || c.epoch != epoch_) return;
  int64_t step = c.step;
  accepted_ = std::max(accepted_, peer::LiveCopy{epoch_, step + 1});
  KnowReleasedLocked(c.epoch, step);
  if (vote_ && vote_->step <= step) vote_.reset();
  bool checkpoint = c.checkpoint;
  double lr = c.learning_rate;
  uint64_t epoch = epoch_;
  peer::Message reply = ReplyLocked(peer::Committed{epoch, step + 1});
  actions->push_back([this, step, checkpoint, lr, epoch, reply, from] {
    Status s = host_.CommitStep(epoch, step, checkpoint, lr);
    if (s.code() == Code::kAborted) return;  // the engine belongs to another epoch now
    if (!s.ok()) {
      spdlog::error("cluster: cannot commit step {}: {}", step, s.message());
      return;
    }
    // Replication: the chief hears of the commit once the next shard keeps its copy.
    if (options_.replicate) return ReplicateThenReply(epoch, epoch, step + 1, from, reply);
    SendTo(from, reply);
  });
}

Status ClusterCoordinator::NotChiefLocked() const {
  // UNAVAILABLE: the caller asks the shards who the chief is and tries again.
  if (chief_ < 0) return Unavailable("shard " + std::to_string(me_) + " knows no chief yet (an election is on); retry");
  return Unavailable("shard " + std::to_string(me_) + " is not the chief; the chief is shard " +
                     std::to_string(chief_));
}

// --- workers ----------------------------------------------------------------------------------

Result<VarPlacement> ClusterCoordinator::Place(const std::string& name, DType dtype, const Shape& shape,
                                               const std::string& colocate, bool trainable) {
  MutexLock lock(&mu_);
  if (chief_ != me_) return NotChiefLocked();
  if (!running_) return Unavailable("the cluster is not serving yet: " + missing_reason_);
  return placement_.Place(name, dtype, shape, colocate, trainable);
}

Status ClusterCoordinator::Placements(std::vector<VarPlacement>* out, std::vector<uint64_t>* shard_bytes) const {
  MutexLock lock(&mu_);
  if (chief_ != me_) return NotChiefLocked();
  if (!running_) return Unavailable("the cluster is not serving yet: " + missing_reason_);
  *out = placement_.All();
  *shard_bytes = placement_.shard_bytes();
  return Status::Ok();
}

void ClusterCoordinator::SetLocalRequired(int required) {
  peer::Message hb;
  {
    MutexLock lock(&mu_);
    local_required_ = required;
    if (chief_ != me_ || required == required_) return;
    required_ = required;
    hb = HeartbeatLocked();
  }
  host_.SetRequired(required);
  SendToAll(hb, /*include_self=*/false);
}

void ClusterCoordinator::OnJobDone() {
  peer::Message msg;
  // Async/ssp: the final checkpoint is labelled with the chief's count (every push is in).
  const int64_t applied = options_.applies_on_arrival ? host_.global_step() : 0;
  {
    MutexLock lock(&mu_);
    if (chief_ != me_ || job_done_) return;
    // The final checkpoint, unless the last commit already made one at this step.
    int64_t step = options_.applies_on_arrival ? applied : open_step_;
    bool can = !options_.checkpoint_dir.empty() && running_ && commit_in_flight_ < 0 &&
               (sealed_.empty() || sealed_.front() != step);
    msg = MessageLocked(peer::Control{epoch_, true, can ? step : -1, -1});
  }
  SendToAll(msg, /*include_self=*/true);
}

void ClusterCoordinator::HandleControl(int from, uint64_t term, uint64_t sender, const peer::Control& c,
                                       std::vector<Action>* actions) {
  if (!AcceptChiefLocked(from, sender, term, actions)) return;
  if (!c.job_done) {
    // An order for the engine of the chief's epoch (a stale one's is ignored).
    if (c.epoch != epoch_ || job_done_) return;
    uint64_t epoch = epoch_;
    if (c.force_step >= 0) {
      actions->push_back([this, epoch, step = c.force_step] { host_.ForceStep(epoch, step); });
    } else if (c.snapshot_step >= 0 && options_.applies_on_arrival && !options_.checkpoint_dir.empty()) {
      // Once per step: the same order again (a duplicate) would snapshot this shard's count as it
      // is now and write the part of that step a second time, over the one the chief's seal names.
      if (arrival_snapshot_epoch_ == epoch && c.snapshot_step <= arrival_snapshot_) return;
      arrival_snapshot_epoch_ = epoch;
      arrival_snapshot_ = c.snapshot_step;
      actions->push_back([this, epoch, step = c.snapshot_step] {
        Status s = host_.SnapshotAs(epoch, step);
        if (!s.ok() && s.code() != Code::kAborted) spdlog::error("cluster: checkpoint step {}: {}", step, s.message());
      });
    }
    return;
  }
  // The job's end counts at any epoch: a shard that never joined the chief's epoch (the cluster
  // waits for an operator, say) ends with the others.
  if (job_done_) return;
  job_done_ = true;
  int64_t step = c.snapshot_step;
  final_step_ = step;
  spdlog::info("cluster: every worker finished{}", step >= 0 ? fmt::format("; final checkpoint at step {}", step) : "");
  if (options_.applies_on_arrival && step >= 0 && step == arrival_snapshot_) {
    // Async/ssp: the chief's count had not moved since its last order, whose part is written (or
    // queued) already: that checkpoint is the final one; its seal ends the job.
    bool sealed = std::find(sealed_.begin(), sealed_.end(), step) != sealed_.end();
    awaiting_final_seal_ = !sealed;
    actions->push_back([this, sealed] {
      host_.EndTraining(-1);
      if (sealed) host_.FinishJob();
    });
    return;
  }
  actions->push_back([this, step] {
    if (!host_.EndTraining(step)) return host_.FinishJob();
    // The seal finishes the job (HandleSeal), or the tick gives up on it (FinalSealTickLocked).
    MutexLock lock(&mu_);
    awaiting_final_seal_ = true;
  });
}

void ClusterCoordinator::FinalSealTickLocked(Clock::time_point now, std::vector<Action>* actions) {
  if (!awaiting_final_seal_) return;
  // However long a large part takes to write, it is waited for; then the seal has
  // final_seal_timeout to come (it never does if a shard died meanwhile).
  if (writer_busy_) {
    final_seal_deadline_.reset();
    return;
  }
  if (!final_seal_deadline_) final_seal_deadline_ = now + options_.final_seal_timeout;
  if (now < *final_seal_deadline_) return;
  awaiting_final_seal_ = false;
  actions->push_back([this] { host_.FinishJob(); });
}

void ClusterCoordinator::OnPrepared(uint64_t epoch, int64_t step, int min_gradients, int max_gradients, int takes,
                                    bool forced) {
  peer::Message msg;
  int chief = -1;
  {
    MutexLock lock(&mu_);
    if (epoch != epoch_) return;  // a stale engine: the next formation redoes it
    // Workers' gradients for `step`: its tokens went out (known here even if the chief that
    // released them is cut off before it says so).
    if (takes > 0) KnowReleasedLocked(epoch, step);
    // Kept until the step commits: the engine reports a step once, and a follower that lost its
    // chief for a moment and finds it again (same term, nothing re-formed) must still vote, or the
    // chief waits for it forever (ResendVoteLocked).
    vote_ = peer::Prepared{epoch, step, min_gradients, max_gradients, takes, forced};
    vote_to_ = chief_;
    if (chief_ < 0) return;  // sent once a chief is known
    msg = ReplyLocked(*vote_);
    chief = chief_;
  }
  SendTo(chief, msg);
}

void ClusterCoordinator::SaveTermLocked(std::vector<Action>* actions) {
  if (term_ <= saved_term_) return;
  saved_term_ = term_;
  uint64_t term = term_;
  actions->push_back([this, term] { host_.SaveTerm(term); });
}

void ClusterCoordinator::ResendVoteLocked(std::vector<Action>* actions) {
  if (!vote_ || vote_->epoch != epoch_ || chief_ < 0 || chief_ == vote_to_) return;
  vote_to_ = chief_;
  peer::Message msg = ReplyLocked(*vote_);
  int chief = chief_;
  actions->push_back([this, chief, msg] { SendTo(chief, msg); });
}

}  // namespace psd::server
