// ClusterCoordinator (cluster/coordinator.h), its takeover side (--replicas-per-shard 2 with
// --takeover-after-ms): a shard whose process is gone is served by a stand-in that the next shard
// runs, from the copy of its state the next shard keeps, until its own process comes back.
//
// Who serves shard d is decided by the chief alone, from the heartbeats it gets: d's own process
// (at its --cluster entry) when heard within an election timeout, else a stand-in heard within one
// (at the address its heartbeats give), else wherever it was. The chief's heartbeats carry the
// shards served away from their entry; followers send to where the chief says, workers ask any
// shard (status replies list every shard's address). A change is a formation: the shard's state
// is restored where it is now served, from the live copies (the stand-in fetches its part from the
// next shard, which keeps it), so nothing committed is lost and no update is applied twice.
//
// The next shard (d + 1 mod P) starts a stand-in once d has not been alive, in its own view, for
// takeover_after, and only if it keeps a copy of d's part; it stops it as soon as it hears d's own
// process again (the chief then moves d back, and d's process restores from the same copies). A
// stand-in starts no stand-in itself.
//
// The stand-in also kept the copies of d's predecessor's part (it was the next shard of that
// part). Those do not go with it: its host takes them when it stops it and hands them to d's own
// process (HandBackLocked: ReplicaChunk.hand_back), which keeps them unless a restore from a
// checkpoint there has left their timeline (TakeHandedBackLocked). Else a fault of d - 1 before its
// next copy reached d's own process would leave no copy of its part.
//
// Partitions: a part is served by a stand-in only while the chief hears the own processes of a
// majority of the shards (MajorityLocked; with an even count, half including shard 0's). Without
// it, the two sides of a partition could each stand in for the other and both serve every part;
// with it, the side without a majority waits (its chief stops serving if it was). So with 2
// shards, shard 1 can be served by a stand-in on shard 0, and shard 0 only by its own process.
//
// While a stand-in serves d, d's part and its copy live on the same host: losing that host too
// before d's process is back leaves no copy of d's part. A formation through a stand-in restores
// only from live copies, never older than a step known released (StartFormationLocked); else the
// chief waits for every shard's own process, and then falls back to the newest common checkpoint
// (and says so). Async/ssp, where each part moves on its own and no released step bounds it: every
// shard remembers which parts a stand-in served in the newest epoch that served them (served_,
// passed on in heartbeats), and a formation from the newest copies waits while such a part's host
// (shard d + 1's own process) is not heard — cut off, it may still keep pushes acknowledged after
// the others last heard of it (CopiesHostMissingLocked).
#include <spdlog/spdlog.h>

#include "cluster/coordinator.h"

namespace psd::server {

void ClusterCoordinator::SetAddress(std::string address) {
  MutexLock lock(&mu_);
  address_ = std::move(address);
  addresses_[static_cast<size_t>(me_)] = address_;
}

std::vector<std::string> ClusterCoordinator::Addresses() const {
  MutexLock lock(&mu_);
  return addresses_;
}

void ClusterCoordinator::OnStandInEnded() {
  MutexLock lock(&mu_);
  if (!stand_in_running_) return;
  stand_in_running_ = false;
  predecessor_gone_.reset();  // counted again from now
}

void ClusterCoordinator::TakeoverTickLocked(Clock::time_point now, std::vector<Action>* actions) {
  HandBackLocked(now, actions);
  if (options_.stand_in || options_.takeover_after.count() <= 0 || shards_ < 2) return;
  const int d = Predecessor();
  if (AliveLocked(d, now)) {
    predecessor_gone_.reset();
    return;
  }
  if (!predecessor_gone_) predecessor_gone_ = now;
  if (stand_in_running_ || now - *predecessor_gone_ < options_.takeover_after) return;
  if (held_copies_.empty()) return;  // nothing to serve d's part from (it never committed here)
  if (!MajorityLocked(now)) return;  // the chief could not use it (the minority side of a partition)
  stand_in_running_ = true;
  hand_back_.clear();  // d's own process is gone again: a stand-in keeps that part's copies again
  spdlog::warn(
      "cluster: shard {} ({}) has been gone for {} ms: this shard starts a stand-in for it, serving its part from "
      "the copies kept here (the newest of step {}; the chief picks the step the cluster restores) until its own "
      "process is back",
      d, options_.addresses[static_cast<size_t>(d)], options_.takeover_after.count(), held_copies_.front().step);
  actions->push_back([this, d, links = addresses_] { host_.StartStandIn(d, links); });
}

bool ClusterCoordinator::MajorityLocked(Clock::time_point now) const {
  const auto timeout = std::chrono::milliseconds(options_.election_timeout_ms);
  const Clock::time_point never{};
  int heard = 0;
  bool first = false;
  for (int i = 0; i < shards_; ++i) {
    const Peer& p = peers_[static_cast<size_t>(i)];
    const bool own = i == me_ ? !options_.stand_in : p.original_heard != never && now - p.original_heard < timeout;
    if (!own) continue;
    ++heard;
    first = first || i == 0;
  }
  return 2 * heard > shards_ || (2 * heard == shards_ && first);
}

void ClusterCoordinator::NoteServedLocked(bool restored) {
  if (!options_.applies_on_arrival || !options_.replicate || epoch_ == 0) return;
  if (!restored && !(chief_ == me_ ? running_ : serving_)) return;
  std::vector<peer::PartServed> now(static_cast<size_t>(shards_));
  for (int i = 0; i < shards_; ++i) {
    const bool stand_in = i == me_ ? options_.stand_in : AddressOf(i) != options_.addresses[static_cast<size_t>(i)];
    now[static_cast<size_t>(i)] = {epoch_, stand_in};
  }
  HearServedLocked(now);
}

void ClusterCoordinator::HearServedLocked(const std::vector<peer::PartServed>& told) {
  if (!options_.applies_on_arrival || !options_.replicate || told.empty()) return;
  served_.resize(static_cast<size_t>(shards_));
  for (size_t k = 0; k < told.size() && k < served_.size(); ++k) served_[k] = std::max(served_[k], told[k]);
}

int ClusterCoordinator::CopiesHostMissingLocked(Clock::time_point now) const {
  for (int d = 0; d < shards_ && static_cast<size_t>(d) < served_.size(); ++d) {
    if (!served_[static_cast<size_t>(d)].stand_in) continue;
    const int host = (d + 1) % shards_;
    const bool heard = host == me_
                           ? !options_.stand_in
                           : AddressOf(host) == options_.addresses[static_cast<size_t>(host)] && AliveLocked(host, now);
    if (!heard) return d;
  }
  return -1;
}

bool ClusterCoordinator::StandInServesLocked() const {
  if (options_.stand_in) return true;
  for (int i = 0; i < shards_; ++i) {
    if (i != me_ && AddressOf(i) != options_.addresses[static_cast<size_t>(i)]) return true;
  }
  return false;
}

void ClusterCoordinator::ChiefMapLocked(Clock::time_point now, std::vector<Action>* actions) {
  const auto timeout = std::chrono::milliseconds(options_.election_timeout_ms);
  const Clock::time_point never{};
  const bool majority = MajorityLocked(now);
  for (int i = 0; i < shards_; ++i) {
    if (i == me_) continue;
    const Peer& p = peers_[static_cast<size_t>(i)];
    const std::string& entry = options_.addresses[static_cast<size_t>(i)];
    std::string want = AddressOf(i);
    const bool stand_in = !p.stand_in_address.empty() && p.stand_in_heard != never && now - p.stand_in_heard < timeout;
    const bool own = p.original_heard != never && now - p.original_heard < timeout;
    if (own) {
      want = entry;
    } else if (stand_in && majority) {
      want = p.stand_in_address;
    } else if (!stand_in) {
      want = entry;  // a stand-in gone (its host stopped it, or died): its shard is looked for at home
    }
    if (want == AddressOf(i)) continue;
    if (want == entry && own) {
      spdlog::warn("cluster: shard {} is back at {}: it serves its part again (was served by a stand-in at {})", i,
                   entry, AddressOf(i));
    } else if (want == entry) {
      spdlog::warn("cluster: the stand-in serving shard {} at {} is gone: shard {} is looked for at {} again", i,
                   AddressOf(i), i, entry);
    } else {
      spdlog::warn("cluster: shard {} ({}) is served by a stand-in at {} from now on", i, entry, want);
    }
    MoveLocked(i, want, actions);
    if (running_ || forming_) {
      forming_ = false;
      DegradeLocked("shard " + std::to_string(i) + " moved to " + want, actions);
    }
  }
}

void ClusterCoordinator::FollowerMapLocked(Clock::time_point now, std::vector<Action>* actions) {
  const auto timeout = std::chrono::milliseconds(options_.election_timeout_ms);
  const Clock::time_point never{};
  for (int i = 0; i < shards_; ++i) {
    const std::string& entry = options_.addresses[static_cast<size_t>(i)];
    if (i == me_ || AddressOf(i) == entry) continue;
    const Peer& p = peers_[static_cast<size_t>(i)];
    bool own = p.original_heard != never && now - p.original_heard < timeout;
    bool stand_in = p.stand_in_heard != never && now - p.stand_in_heard < timeout;
    // (A chief gone too: its map is old news, and the shard may be back at home, sending to a
    // stand-in of ours that is gone as well — each would wait for the other.)
    if (stand_in || !(own || chief_ < 0 || ChiefGoneLocked(now))) continue;
    spdlog::info("cluster: the stand-in serving shard {} at {} is not heard: sending to {} again", i, AddressOf(i),
                 entry);
    MoveLocked(i, entry, actions);
  }
}

void ClusterCoordinator::MoveLocked(int shard, const std::string& address, std::vector<Action>* actions) {
  addresses_[static_cast<size_t>(shard)] = address;
  moved_since_formation_ = true;
  // Another process serves it now: what the last one said (its copies, checkpoints, readiness)
  // is not this one's. A formation waits for its first heartbeat.
  Peer& p = peers_[static_cast<size_t>(shard)];
  p.ready = false;
  p.last_heartbeat = Clock::time_point{};
  p.sealed.clear();
  p.seal_digests.clear();
  p.unusable.clear();
  p.unsealed_parts.clear();
  p.own_copies.clear();
  p.held_copies.clear();
  actions->push_back([this, shard, address] { network_.Retarget(shard, address); });
}

std::map<int, std::string> ClusterCoordinator::MovedLocked() const {
  std::map<int, std::string> moved;
  for (int i = 0; i < shards_; ++i) {
    if (AddressOf(i) != options_.addresses[static_cast<size_t>(i)]) moved[i] = AddressOf(i);
  }
  return moved;
}

void ClusterCoordinator::FollowMapLocked(const std::map<int, std::string>& moved, std::vector<Action>* actions) {
  for (int i = 0; i < shards_; ++i) {
    if (i == me_) continue;
    auto it = moved.find(i);
    const std::string& want = it != moved.end() ? it->second : options_.addresses[static_cast<size_t>(i)];
    if (want != AddressOf(i)) MoveLocked(i, want, actions);
  }
}

void ClusterCoordinator::TakeoverHeartbeatLocked(int from, uint64_t term, uint64_t sender, const peer::Heartbeat& hb,
                                                 bool served, std::vector<Action>* actions) {
  // The chief's map: followers send where it says.
  if (served && FromLeaderLocked(from, sender, term) && chief_ != me_) FollowMapLocked(hb.moved, actions);
  // The predecessor's own process is back: the stand-in makes way (the chief moves it back).
  if (stand_in_running_ && from == Predecessor() && !hb.stand_in) {
    stand_in_running_ = false;
    predecessor_gone_.reset();
    spdlog::warn("cluster: shard {} is back at {}: stopping its stand-in", from,
                 options_.addresses[static_cast<size_t>(from)]);
    actions->push_back([this] {
      StandInLeft left = host_.StopStandIn();
      std::vector<Action> more;
      {
        MutexLock lock(&mu_);
        // The newest copies it knew of: said from now on (a formation must not restore older ones).
        HearCopiesLocked(me_, left.kept);
        hand_back_.clear();
        for (auto& [copy, bytes] : left.held) {
          if (bytes && !bytes->empty()) hand_back_.push_back(HandBack{copy, std::move(bytes)});
        }
        HandBackLocked(now_(), &more);
        ToLaneLocked(&more);
      }
      RunActions(&more);
    });
  }
}

void ClusterCoordinator::HandBackLocked(Clock::time_point now, std::vector<Action>* actions) {
  if (hand_back_.empty()) return;
  const int d = Predecessor();
  const std::string& entry = options_.addresses[static_cast<size_t>(d)];
  if (AddressOf(d) != entry) return;  // its link still goes to the stand-in (or to another one)
  const int owner = (d + shards_ - 1) % shards_;
  const auto again = std::chrono::milliseconds(options_.election_timeout_ms);
  for (auto it = hand_back_.begin(); it != hand_back_.end();) {
    HandBack& h = *it;
    // Not before it could have arrived (at 64 MiB/s), as a copy's ack (ReplicationTickLocked).
    if (h.sends > 0 && now - h.sent <= again + std::chrono::milliseconds(h.bytes->size() >> 16)) {
      ++it;
      continue;
    }
    if (h.sends == kMaxHandBackSends) {
      spdlog::warn(
          "cluster: shard {} at {} did not acknowledge the copy of shard {}'s step {} that its stand-in kept, sent "
          "{} times; dropped (shard {}'s own copies and its next commit's are its copies from now on)",
          d, entry, owner, h.copy.step, h.sends, owner);
      it = hand_back_.erase(it);
      continue;
    }
    if (h.sends == 0) {
      spdlog::info(
          "cluster: handing the copy of shard {}'s step {} (lineage {}) that the stand-in kept to shard {} at {}",
          owner, h.copy.step, h.copy.lineage, d, entry);
    }
    ++h.sends;
    h.sent = now;
    actions->push_back([this, d, epoch = epoch_, owner, copy = h.copy, bytes = h.bytes] {
      SendCopy(d, epoch, owner, copy, /*restore=*/false, bytes, /*hand_back=*/true);
    });
    ++it;
  }
}

}  // namespace psd::server
