// ClusterCoordinator (cluster/coordinator.h), its replication side (--replicas-per-shard 2):
// chain replication of each shard's committed state to the next shard, and formations from those
// live copies instead of a checkpoint.
//
// Each shard keeps its own state at its last two committed steps, and its predecessor's (shard
// i's copies live on shard i + 1 mod P). A copy's lineage is the epoch that committed its step
// (or restored it from a checkpoint): the steps one epoch commits differ from those another
// committed after the same step (workers recompute them), so copies of two lineages never mix. A
// formation from live copies keeps their lineage (it makes no new state) and drops only the
// copies newer than the one it restores (steps committed on some shards and never released): a
// fault during it still finds the older ones.
//
// Two steps are kept because a commit is not atomic across shards: a chief that dies between
// the shards' commits of step s leaves some at s and some at s + 1 (with s + 1 prepared); the
// formation takes s, which every part has, and no worker was given a token for s + 1.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <iterator>
#include <set>
#include <vector>

#include "cluster/coordinator.h"

namespace psd::server {

std::optional<peer::LiveCopy> ClusterCoordinator::LiveChoiceLocked() const {
  auto own = [this](int k) -> const std::vector<peer::LiveCopy>& {
    mu_.AssertHeld();  // held by the caller: the analysis does not follow into the lambda
    return k == me_ ? own_copies_ : peers_[static_cast<size_t>(k)].own_copies;
  };
  auto held = [this](int k) -> const std::vector<peer::LiveCopy>& {
    mu_.AssertHeld();
    return k == me_ ? held_copies_ : peers_[static_cast<size_t>(k)].held_copies;
  };
  // Sorted vectors (GCC 12 misreads a std::set swapped in a loop as a dangling pointer).
  std::vector<peer::LiveCopy> common;
  for (int k = 0; k < shards_; ++k) {
    // Part k is kept by shard k and by shard k + 1.
    std::vector<peer::LiveCopy> here = own(k);
    const auto& next = held((k + 1) % shards_);
    here.insert(here.end(), next.begin(), next.end());
    std::sort(here.begin(), here.end());
    here.erase(std::unique(here.begin(), here.end()), here.end());
    if (k == 0) {
      common = std::move(here);
      continue;
    }
    std::vector<peer::LiveCopy> both;
    std::set_intersection(common.begin(), common.end(), here.begin(), here.end(), std::back_inserter(both));
    common = std::move(both);
  }
  // A checkpoint that every shard can restore (or that this chief can reseal everywhere), newer
  // than the newest common copy (a shard and the one keeping its copies went down between): the
  // checkpoint path forms at it. A checkpoint sealed on some shards only does not count: it could
  // not be restored, and the copies are newer than what could.
  std::set<int64_t> restorable = CommonStepsLocked();
  int64_t newest_checkpoint = restorable.empty() ? -1 : *restorable.rbegin();
  for (const auto& [step, parts] : seal_parts_) {
    if (step > newest_checkpoint && ResealableLocked(step)) newest_checkpoint = step;
  }
  for (auto it = common.rbegin(); it != common.rend(); ++it) {
    if (live_failed_.count(*it) == 0) return it->step >= newest_checkpoint ? std::optional(*it) : std::nullopt;
  }
  return std::nullopt;
}

void ClusterCoordinator::SendCopy(int shard, uint64_t epoch, int owner, const peer::LiveCopy& copy, bool restore,
                                  const std::shared_ptr<const std::string>& bytes) {
  peer::Message msg;
  {
    MutexLock lock(&mu_);
    msg = MessageLocked(peer::ReplicaChunk{epoch, owner, copy, restore, 0, 0, {}});
  }
  auto& chunk = std::get<peer::ReplicaChunk>(msg.body);
  if (!bytes || bytes->empty()) {  // a copy not held (restore), or nothing to send
    SendTo(shard, msg);
    return;
  }
  const uint64_t total = bytes->size();
  const uint64_t piece = std::max<uint64_t>(1, options_.replica_chunk_bytes);
  chunk.total = total;
  for (uint64_t off = 0; off < total; off += piece) {
    chunk.offset = off;
    chunk.data.assign(*bytes, off, std::min(piece, total - off));
    SendTo(shard, msg);
  }
}

void ClusterCoordinator::ReplicateThenReply(uint64_t epoch, uint64_t lineage, int64_t step, int to,
                                            peer::Message reply) {
  const peer::LiveCopy copy{lineage, step};
  std::shared_ptr<const std::string> bytes = host_.KeepCopy(epoch, copy);
  if (!bytes) return;  // logged by the host; the chief's commit or formation times out
  {
    MutexLock lock(&mu_);
    if (stopped_ || epoch_ != epoch) return;
    ack_ = PendingAck{epoch, copy, to, std::move(reply), bytes, now_()};
  }
  SendCopy(Successor(), epoch, me_, copy, /*restore=*/false, bytes);
}

void ClusterCoordinator::StartLiveRestoreLocked(uint64_t epoch, const peer::LiveCopy& copy,
                                                std::vector<Action>* actions) {
  live_restores_[epoch] = copy;
  while (live_restores_.size() > 8) live_restores_.erase(live_restores_.begin());
  // Newer copies are of steps the cluster leaves (committed on some shards only, never released).
  actions->push_back([this, copy] { host_.DropCopies(copy); });
  const bool own = std::find(own_copies_.begin(), own_copies_.end(), copy) != own_copies_.end();
  if (own) {
    actions->push_back([this, epoch, copy] {
      host_.RestoreCopyAsync(epoch, copy, [this, epoch, copy](Status s, std::vector<VarPlacement> placements) {
        RestoreDone(epoch, copy.step, s, std::move(placements));
      });
    });
    return;
  }
  // Lost here (a restart): the next shard keeps it.
  spdlog::info("cluster: shard {} fetches its live copy of step {} from shard {}", me_, copy.step, Successor());
  fetch_.emplace(epoch, copy);
  fetch_sent_ = now_();
  peer::Message msg = MessageLocked(peer::ReplicaFetch{epoch, copy});
  actions->push_back([this, msg] { SendTo(Successor(), msg); });
}

void ClusterCoordinator::ReplicationTickLocked(Clock::time_point now, std::vector<Action>* actions) {
  // A copy or a fetch whose answer may have been lost with a broken link: sent again. A big copy
  // takes a while on the wire: it is not sent again before it could have arrived (at 64 MiB/s).
  const auto again = std::chrono::milliseconds(options_.election_timeout_ms);
  if (ack_ && now - ack_->sent > again + std::chrono::milliseconds(ack_->bytes->size() >> 16)) {
    ack_->sent = now;
    actions->push_back([this, epoch = ack_->epoch, copy = ack_->copy, bytes = ack_->bytes] {
      SendCopy(Successor(), epoch, me_, copy, /*restore=*/false, bytes);
    });
  }
  if (fetch_ && now - fetch_sent_ > again) {
    fetch_sent_ = now;
    peer::Message msg = MessageLocked(peer::ReplicaFetch{fetch_->first, fetch_->second});
    actions->push_back([this, msg] { SendTo(Successor(), msg); });
  }
}

void ClusterCoordinator::HandleReplicaChunk(int from, const peer::ReplicaChunk& c, std::vector<Action>* actions) {
  if (!options_.replicate || from == me_) return;
  // Copies come only from their owner (to keep) or from the shard that keeps ours (a restore).
  if (c.restore ? (from != Successor() || c.owner != me_) : (from != Predecessor() || c.owner != from)) return;
  if (c.restore && !(fetch_ && fetch_->first == c.epoch && fetch_->second == c.copy)) return;
  if (c.total > options_.max_copy_bytes) {
    spdlog::warn("cluster: shard {} sent a copy of {} bytes, more than this shard takes ({}); dropped", from, c.total,
                 options_.max_copy_bytes);
    return;
  }
  if (c.restore) fetch_sent_ = now_();  // the copy is coming: not asked for again meanwhile
  if (c.restore && c.total == 0) {
    uint64_t epoch = fetch_->first;
    fetch_.reset();
    actions->push_back([this, epoch, step = c.copy.step, next = from] {
      RestoreDone(epoch, step,
                  FailedPrecondition("shard " + std::to_string(next) + " does not keep this shard's live copy"), {});
    });
    return;
  }
  Incoming& in = incoming_[{c.owner, c.restore}];
  if (c.offset == 0) {
    in.copy = c.copy;
    in.bytes.clear();
    in.bytes.reserve(std::min<uint64_t>(c.total, 256ull << 20));  // grows past it as pieces come
  } else if (in.copy != c.copy || in.bytes.size() != c.offset) {
    return;  // a piece of a copy whose start was lost (it is sent again whole)
  }
  in.bytes += c.data;
  if (in.bytes.size() < c.total) return;
  auto bytes = std::make_shared<std::string>(std::move(in.bytes));
  incoming_.erase({c.owner, c.restore});
  if (!c.restore) {
    peer::Message ack = MessageLocked(peer::ReplicaAck{c.epoch, c.copy});
    actions->push_back([this, from, copy = c.copy, bytes, ack] {
      Status s = host_.TakeCopy(from, copy, bytes);
      if (!s.ok()) {
        spdlog::error("cluster: shard {}'s copy of step {} is unusable: {}", from, copy.step, s.message());
        return;
      }
      SendTo(from, ack);
    });
    return;
  }
  uint64_t epoch = fetch_->first;
  fetch_.reset();
  actions->push_back([this, epoch, copy = c.copy, bytes] {
    Status s = host_.TakeCopy(me_, copy, bytes);
    if (!s.ok()) return RestoreDone(epoch, copy.step, s, {});
    host_.RestoreCopyAsync(epoch, copy, [this, epoch, copy](Status st, std::vector<VarPlacement> placements) {
      RestoreDone(epoch, copy.step, st, std::move(placements));
    });
  });
}

void ClusterCoordinator::HandleReplicaAck(int from, const peer::ReplicaAck& a, std::vector<Action>* actions) {
  if (!options_.replicate || from != Successor() || !ack_ || ack_->epoch != a.epoch || ack_->copy != a.copy) return;
  int to = ack_->to;
  peer::Message reply = std::move(ack_->reply);
  ack_.reset();
  actions->push_back([this, to, reply] { SendTo(to, reply); });
}

void ClusterCoordinator::HandleReplicaFetch(int from, const peer::ReplicaFetch& f, std::vector<Action>* actions) {
  if (!options_.replicate || from != Predecessor() || from == me_) return;
  actions->push_back(
      [this, from, f] { SendCopy(from, f.epoch, from, f.copy, /*restore=*/true, host_.SerializedCopy(from, f.copy)); });
}

}  // namespace psd::server
