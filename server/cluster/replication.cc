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
//
// Async and ssp have no step commit: each shard copies its part at its own count, on arrival.
// A push's reply waits until a copy taken after the push was applied is kept by the next shard
// (AfterReplicated); one copy is taken or in flight at a time, and the next one covers every push
// applied meanwhile (a group commit). A formation then loses nothing acknowledged: each shard
// restores the newest copy of its part — its own, or the one the next shard keeps if it lost its
// own (a restart, a stand-in) — and the parts need no common step (a cut across shards, as
// async checkpoints are). The lineage stays: a formation from copies makes no new timeline.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cluster/coordinator.h"

namespace psd::server {

const std::vector<peer::LiveCopy>& ClusterCoordinator::OwnCopiesLocked(int k) const {
  return k == me_ ? own_copies_ : peers_[static_cast<size_t>(k)].own_copies;
}

const std::vector<peer::LiveCopy>& ClusterCoordinator::HeldCopiesLocked(int k) const {
  return k == me_ ? held_copies_ : peers_[static_cast<size_t>(k)].held_copies;
}

uint64_t ClusterCoordinator::NewestLineageLocked() const {
  uint64_t newest = 0;
  auto note = [&newest](const std::vector<peer::LiveCopy>& copies) {
    for (const peer::LiveCopy& c : copies) newest = std::max(newest, c.lineage);
  };
  for (int k = 0; k < shards_; ++k) {
    note(OwnCopiesLocked(k));
    note(HeldCopiesLocked(k));
  }
  note(newest_heard_);
  return newest;
}

std::optional<peer::LiveCopy> ClusterCoordinator::LiveChoiceLocked() const {
  // Sorted vectors (GCC 12 misreads a std::set swapped in a loop as a dangling pointer).
  std::vector<peer::LiveCopy> common;
  for (int k = 0; k < shards_; ++k) {
    // Part k is kept by shard k and by shard k + 1.
    std::vector<peer::LiveCopy> here = OwnCopiesLocked(k);
    const auto& next = HeldCopiesLocked((k + 1) % shards_);
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

namespace {

// The chunks of a copy: `msg` (a ReplicaChunk with its total set) for each, in order.
PeerNetwork::MessageStream CopyChunks(peer::Message msg, std::shared_ptr<const peer::CopyBytes> bytes,
                                      uint64_t chunk_bytes) {
  // A piece of the copy that fills a chunk (or 64 KiB) goes in chunks of whole words that share
  // its memory (the daemon's encoder writes them from it, uncopied: a tensor of the owner's state,
  // or a copy kept as it came). The rest — the records, small tensors, the bytes past a piece's
  // last whole word — is gathered into chunks of their own. Made one at a time, as the network
  // asks for the next.
  struct State {
    peer::Message msg;
    std::shared_ptr<const peer::CopyBytes> bytes;
    uint64_t chunk_max = 0, shared_min = 0;
    size_t piece = 0;    // the piece being sent
    uint64_t off = 0;    // in it
    uint64_t words = 0;  // its bytes sent from its own memory (-1: not worked out yet)
    uint64_t at = 0;     // where it lies in the copy
    std::string gathered;
    uint64_t gathered_at = 0;
  };
  auto st = std::make_shared<State>();
  st->msg = std::move(msg);
  st->bytes = std::move(bytes);
  st->chunk_max = std::max<uint64_t>(8, chunk_bytes / 8 * 8);
  st->shared_min = std::min<uint64_t>(st->chunk_max, 64 << 10);
  st->words = UINT64_MAX;
  return [st]() -> std::optional<peer::Message> {
    auto chunk = [&](uint64_t at, peer::Blob data) {
      peer::Message m = st->msg;
      auto& c = std::get<peer::ReplicaChunk>(m.body);
      c.offset = at;
      c.data = std::move(data);
      return m;
    };
    auto flush = [&] { return chunk(st->gathered_at, peer::Blob(std::exchange(st->gathered, {}))); };
    const std::vector<peer::Blob>& pieces = st->bytes->pieces();
    while (st->piece < pieces.size()) {
      const peer::Blob& p = pieces[st->piece];
      if (st->words == UINT64_MAX) {
        const bool aligned = reinterpret_cast<uintptr_t>(p.data()) % 8 == 0;
        st->words = aligned && p.size() >= st->shared_min ? p.size() / 8 * 8 : 0;
      }
      if (st->off < st->words) {
        if (!st->gathered.empty()) return flush();
        const uint64_t len = std::min(st->chunk_max, st->words - st->off);
        peer::Message m = chunk(st->at + st->off, peer::Blob(p.keep(), p.data() + st->off, len));
        st->off += len;
        return m;
      }
      while (st->off < p.size()) {
        if (st->gathered.empty()) st->gathered_at = st->at + st->off;
        const uint64_t len = std::min<uint64_t>(p.size() - st->off, st->chunk_max - st->gathered.size());
        st->gathered.append(p.data() + st->off, len);
        st->off += len;
        if (st->gathered.size() >= st->chunk_max) return flush();
      }
      st->at += p.size();
      st->off = 0;
      st->words = UINT64_MAX;
      ++st->piece;
    }
    if (!st->gathered.empty()) return flush();
    return std::nullopt;
  };
}

}  // namespace

void ClusterCoordinator::SendCopy(int shard, uint64_t epoch, int owner, const peer::LiveCopy& copy, bool restore,
                                  const std::shared_ptr<const peer::CopyBytes>& bytes, bool hand_back,
                                  std::shared_ptr<CopyStream> stream) {
  // The sending ends when its last piece goes, or when the network lets the rest go (a link that
  // broke, a full queue, a link moved): then it may be sent again. Its pieces share one holder,
  // which says so when the last copy of the stream is gone, whichever way.
  struct Ending {
    std::shared_ptr<CopyStream> stream;
    std::function<Clock::time_point()> now;
    ~Ending() {
      if (!stream || stream->done) return;
      stream->done_at = now().time_since_epoch().count();
      stream->done = true;
    }
  };
  auto ending = std::make_shared<Ending>();  // made in place: a copy's end would say it ended
  ending->stream = std::move(stream);
  ending->now = now_;
  peer::Message msg;
  {
    MutexLock lock(&mu_);
    msg = MessageLocked(peer::ReplicaChunk{epoch, owner, copy, restore, 0, 0, {}, hand_back});
  }
  if (!bytes || bytes->empty()) {  // a copy not held (restore), or nothing to send
    SendTo(shard, msg);
    return;
  }
  if (shard < 0 || shard >= shards_) return;
  std::get<peer::ReplicaChunk>(msg.body).total = bytes->size();
  PeerNetwork::MessageStream chunks = CopyChunks(std::move(msg), bytes, options_.replica_chunk_bytes);
  if (!ending->stream) return network_.SendStream(shard, std::move(chunks));
  network_.SendStream(shard, [chunks = std::move(chunks), ending]() -> std::optional<peer::Message> {
    if (ending->stream->cancelled) return std::nullopt;
    return chunks();  // the last: ~Ending says so once the network lets the stream go
  });
}

void ClusterCoordinator::DropAckLocked() {
  if (ack_ && ack_->stream) ack_->stream->cancelled = true;
  ack_.reset();
}

std::shared_ptr<ClusterCoordinator::CopyStream> ClusterCoordinator::AwaitAckLocked(PendingAck pending) {
  DropAckLocked();
  pending.stream = std::make_shared<CopyStream>();
  ack_ = std::move(pending);
  return ack_->stream;
}

std::optional<peer::LiveCopy> ClusterCoordinator::CopyBaseLocked(uint64_t epoch, uint64_t lineage) const {
  if (!acked_ || acked_epoch_ != epoch || acked_->lineage != lineage) return std::nullopt;
  return acked_;
}

void ClusterCoordinator::ReplicateThenReply(uint64_t epoch, uint64_t lineage, int64_t step, int to,
                                            peer::Message reply) {
  const peer::LiveCopy copy{lineage, step};
  std::optional<peer::LiveCopy> base;
  {
    MutexLock lock(&mu_);
    base = CopyBaseLocked(epoch, lineage);
  }
  std::shared_ptr<const peer::CopyBytes> bytes = host_.KeepCopy(epoch, copy, base);
  if (!bytes) return;  // logged by the host; the chief's commit or formation times out
  std::shared_ptr<CopyStream> stream;
  {
    MutexLock lock(&mu_);
    if (stopped_ || epoch_ != epoch) return;
    stream = AwaitAckLocked(PendingAck{epoch, copy, to, std::move(reply), bytes, now_()});
  }
  SendCopy(Successor(), epoch, me_, copy, /*restore=*/false, bytes, /*hand_back=*/false, stream);
}

void ClusterCoordinator::StartLiveRestoreLocked(uint64_t epoch, const peer::LiveCopy& copy,
                                                std::vector<Action>* actions) {
  live_restores_[epoch] = copy;
  while (live_restores_.size() > 8) live_restores_.erase(live_restores_.begin());
  // Newer copies are of steps the cluster leaves (committed on some shards only, never released).
  actions->push_back([this, copy, epoch] { host_.DropCopies(copy, epoch); });
  const bool own = std::find(own_copies_.begin(), own_copies_.end(), copy) != own_copies_.end();
  if (own) {
    actions->push_back([this, epoch, copy] { RestoreOwnCopy(epoch, copy); });
    return;
  }
  // Lost here (a restart): the next shard keeps it.
  spdlog::info("cluster: shard {} fetches its live copy of step {} from shard {}", me_, copy.step, Successor());
  fetch_.emplace(epoch, copy);
  fetch_newest_ = false;
  fetch_sent_ = now_();
  peer::Message msg = MessageLocked(peer::ReplicaFetch{epoch, copy});
  actions->push_back([this, msg] { SendTo(Successor(), msg); });
}

void ClusterCoordinator::ReplicationTickLocked(Clock::time_point now, std::vector<Action>* actions) {
  // Replies waiting for a copy the cluster may never take (the next shard is gone, the cluster
  // stopped serving): answered now; the formation to come restores what was acknowledged.
  if (!arrival_waiters_.empty()) {
    const bool serving = chief_ == me_ ? running_ : (serving_ && chief_ >= 0 && AliveLocked(chief_, now));
    if (!serving) {
      FailArrivalWaitersLocked(Unavailable("shard " + std::to_string(me_) +
                                           ": the cluster stopped serving before this push's copy was kept by the "
                                           "next shard; pull and go on"),
                               actions);
    }
  }
  // A copy or a fetch whose answer may have been lost with a broken link: sent again. A copy is
  // not sent again while its last sending is still going out (a big one takes a while on the
  // wire; sendings queued behind each other would hold up everything else on the link), and the
  // wait counts from its last piece, doubling with each sending again (to 8 times).
  const auto again = std::chrono::milliseconds(options_.election_timeout_ms);
  if (ack_ && (!ack_->stream || ack_->stream->done)) {
    Clock::time_point since = ack_->sent;
    if (ack_->stream) since = std::max(since, Clock::time_point(Clock::duration(ack_->stream->done_at.load())));
    if (now - since > again * (1 << std::min(ack_->resends, 3))) {
      ack_->sent = now;
      ++ack_->resends;
      ack_->stream = std::make_shared<CopyStream>();
      actions->push_back([this, epoch = ack_->epoch, copy = ack_->copy, bytes = ack_->bytes, stream = ack_->stream] {
        // Whole: a difference is no use if the next shard lost the copy it is from.
        std::shared_ptr<const peer::CopyBytes> whole = host_.SerializedCopy(me_, copy);
        SendCopy(Successor(), epoch, me_, copy, /*restore=*/false, whole ? whole : bytes, /*hand_back=*/false, stream);
      });
    }
  }
  if (fetch_ && now - fetch_sent_ > again) {
    fetch_sent_ = now;
    peer::Message msg = MessageLocked(peer::ReplicaFetch{fetch_->first, fetch_->second, fetch_newest_});
    actions->push_back([this, msg] { SendTo(Successor(), msg); });
  }
}

void ClusterCoordinator::HandleReplicaChunk(int from, const peer::ReplicaChunk& c, std::vector<Action>* actions) {
  if (!options_.replicate || from == me_) return;
  // Copies come only from their owner (to keep) or from the shard that keeps ours (a restore), or
  // our predecessor's from the host of the stand-in that served us (handed back, takeover.cc).
  if (c.hand_back) {
    if (c.restore || from != Successor() || c.owner != Predecessor()) return;
  } else if (c.restore ? (from != Successor() || c.owner != me_) : (from != Predecessor() || c.owner != from)) {
    return;
  }
  // A copy sent in an older epoch than this shard's (its owner has not heard of the formation that
  // left that epoch) is not kept: acknowledged, it would let the owner acknowledge pushes of a
  // timeline the cluster left (async applies them on arrival), lost at the next formation. (A copy
  // handed back acknowledges nothing to its owner: it is judged by its lineage, below.)
  if (!c.restore && !c.hand_back && c.epoch < epoch_) return;
  // A copy of an epoch this shard has not heard of (formed on the other side of a partition): the
  // next epoch this shard forms is numbered above it (as NewestLineageLocked, before the host says).
  max_term_seen_ = std::max({max_term_seen_, c.epoch, c.copy.lineage});
  // A fetch of the newest copy takes one newer than this shard's own, or an empty answer about it.
  if (c.restore && !(fetch_ && fetch_->first == c.epoch &&
                     (fetch_->second == c.copy || (fetch_newest_ && c.total > 0 && fetch_->second < c.copy)))) {
    return;  // not asked for
  }
  if (c.total > options_.max_copy_bytes) {
    spdlog::warn("cluster: shard {} sent a copy of {} bytes, more than this shard takes ({}); dropped", from, c.total,
                 options_.max_copy_bytes);
    return;
  }
  if (c.restore) fetch_sent_ = now_();  // the copy is coming: not asked for again meanwhile
  if (c.restore && c.total == 0 && fetch_newest_ && (c.copy.step >= 0 || fetch_fallback_)) {
    // The next shard keeps nothing newer than this shard's own newest restorable copy: restored
    // here. None restorable here nor there: its own newest.
    uint64_t epoch = fetch_->first;
    fetch_.reset();
    const peer::LiveCopy copy = c.copy.step >= 0 ? c.copy : *fetch_fallback_;
    live_restores_[epoch] = copy;
    actions->push_back([this, epoch, copy] { RestoreOwnCopy(epoch, copy); });
    return;
  }
  if (c.restore && c.total == 0) {
    uint64_t epoch = fetch_->first;
    fetch_.reset();
    actions->push_back([this, epoch, step = c.copy.step, next = from] {
      RestoreDone(epoch, step,
                  FailedPrecondition("shard " + std::to_string(next) + " does not keep this shard's live copy"), {});
    });
    return;
  }
  const std::tuple<int, bool, bool> key{c.owner, c.restore, c.hand_back};
  Incoming& in = incoming_[key];
  if (c.offset == 0) {
    in.copy = c.copy;
    in.bytes = host_.CopyStorage(c.total);
  } else if (!in.bytes || in.copy != c.copy || in.bytes->size() != c.offset) {
    return;  // a piece of a copy whose start was lost (it is sent again whole)
  }
  in.bytes->append(c.data.data(), c.data.size());
  if (in.bytes->size() < c.total) return;
  std::shared_ptr<const std::string> bytes = std::move(in.bytes);
  incoming_.erase(key);
  if (c.hand_back) return TakeHandedBackLocked(from, c, std::move(bytes), actions);
  if (!c.restore) {
    NotePredecessorCopyLocked(from, c);
    peer::Message ack = MessageLocked(peer::ReplicaAck{c.epoch, c.copy});
    peer::Message refusal = ack;
    std::get<peer::ReplicaAck>(refusal.body).send_whole = true;
    actions->push_back([this, from, copy = c.copy, bytes, ack, refusal] {
      Status s = host_.TakeCopy(from, copy, bytes);
      if (!s.ok()) {
        // A difference from a copy lost here (a restart) is of no use, and a whole copy that does not
        // parse or check is sent again: the copy whole needs no base.
        spdlog::error("cluster: shard {}'s copy of step {} is unusable: {}; asked for it again, whole", from, copy.step,
                      s.message());
        SendTo(from, refusal);
        return;
      }
      {
        // A stand-in being stopped acknowledges nothing it may not have listed for its host to
        // hand back (ServerShardHost::StopStandIn stops it, then lists what it keeps).
        MutexLock lock(&mu_);
        if (stopped_) return;
      }
      SendTo(from, ack);
    });
    return;
  }
  uint64_t epoch = fetch_->first;
  if (fetch_newest_) {
    spdlog::info(
        "cluster: shard {} restores the newer copy of its part that shard {} keeps ({}, step {}; its own newest "
        "restorable: {})",
        me_, from, c.copy.lineage, c.copy.step,
        fetch_->second.step < 0 ? std::string("none")
                                : fmt::format("{}, step {}", fetch_->second.lineage, fetch_->second.step));
  }
  fetch_.reset();
  if (auto it = live_restores_.find(epoch); it != live_restores_.end()) it->second = c.copy;  // a newest fetch's
  actions->push_back([this, epoch, copy = c.copy, bytes] {
    Status s = host_.TakeCopy(me_, copy, bytes);
    if (!s.ok()) return RestoreDone(epoch, copy.step, s, {});
    RestoreOwnCopy(epoch, copy);
  });
}

void ClusterCoordinator::RestoreOwnCopy(uint64_t epoch, const peer::LiveCopy& copy) {
  host_.RestoreCopyAsync(epoch, copy, [this, epoch, copy](Status s, std::vector<VarPlacement> placements) {
    RestoreDone(epoch, copy.step, s, std::move(placements));
  });
}

void ClusterCoordinator::TakeHandedBackLocked(int from, const peer::ReplicaChunk& c,
                                              std::shared_ptr<const std::string> bytes, std::vector<Action>* actions) {
  // Not if it is of a timeline left here since (a restore from a checkpoint or empty). A formation
  // from live copies that left it (LeftCopies) may have chosen on old news (a term led elsewhere
  // released steps past its choice: its shards refuse it, and the next formation chooses again,
  // perhaps this copy); if it did leave it, every shard that took its order dropped it, and one
  // part's copy alone is no choice (LiveChoiceLocked; async judges each copy, RestorableLocked).
  // (Older than the two newest kept here, the host does not keep it either.)
  const bool take = c.copy.lineage >= timeline_epoch_;
  peer::Message ack = MessageLocked(peer::ReplicaAck{c.epoch, c.copy, /*send_whole=*/false, /*hand_back=*/true});
  actions->push_back([this, from, take, owner = c.owner, copy = c.copy, bytes = std::move(bytes), ack] {
    if (take) {
      Status s = host_.TakeCopy(owner, copy, bytes);
      if (!s.ok()) {  // sent again after a while
        spdlog::error("cluster: the copy of shard {}'s step {} handed back by shard {} is unusable: {}", owner,
                      copy.step, from, s.message());
        return;
      }
      spdlog::info("cluster: shard {} keeps the copy of shard {}'s step {} (lineage {}) that its stand-in kept", me_,
                   owner, copy.step, copy.lineage);
    }
    SendTo(from, ack);
  });
}

void ClusterCoordinator::HandleReplicaAck(int from, const peer::ReplicaAck& a, std::vector<Action>* actions) {
  if (a.hand_back) {
    if (from != Predecessor()) return;
    std::erase_if(hand_back_, [&a](const HandBack& h) { return h.copy == a.copy; });
    return;
  }
  if (!options_.replicate || from != Successor() || !ack_ || ack_->epoch != a.epoch || ack_->copy != a.copy) return;
  if (a.send_whole) {
    // The difference was no use there (its base is gone): the copy whole, now. Once per copy: a
    // shard that cannot take even that has the ack's timeout resend it.
    if (ack_->sent_whole) return;
    ack_->sent_whole = true;
    ack_->sent = now_();
    if (ack_->stream) ack_->stream->cancelled = true;  // the difference, if still going out
    ack_->stream = std::make_shared<CopyStream>();
    actions->push_back(
        [this, to = from, epoch = ack_->epoch, copy = ack_->copy, bytes = ack_->bytes, stream = ack_->stream] {
          std::shared_ptr<const peer::CopyBytes> whole = host_.SerializedCopy(me_, copy);
          SendCopy(to, epoch, me_, copy, /*restore=*/false, whole ? whole : bytes, /*hand_back=*/false, stream);
        });
    return;
  }
  acked_ = ack_->copy;
  acked_epoch_ = ack_->epoch;
  if (ack_->to < 0) {  // a copy on arrival: the replies it covers go, and the next copy starts if more wait
    // Kept by the next shard (which may be a stand-in stopped soon): said in every heartbeat.
    HeardLocked(me_, ack_->copy);
    const uint64_t generation = ack_->generation, epoch = ack_->epoch;
    DropAckLocked();
    std::vector<std::function<void(const Status&)>> answered;
    auto keep = std::partition(arrival_waiters_.begin(), arrival_waiters_.end(),
                               [generation](const ArrivalWaiter& w) { return w.generation >= generation; });
    for (auto it = keep; it != arrival_waiters_.end(); ++it) answered.push_back(std::move(it->done));
    arrival_waiters_.erase(keep, arrival_waiters_.end());
    arrival_copying_ = !arrival_waiters_.empty();
    actions->push_back([this, answered = std::move(answered), epoch, next = arrival_copying_] {
      for (const auto& done : answered) done(Status::Ok());
      if (next) StartArrivalCopy(epoch);
    });
    return;
  }
  int to = ack_->to;
  peer::Message reply = std::move(ack_->reply);
  DropAckLocked();
  actions->push_back([this, to, reply] { SendTo(to, reply); });
}

void ClusterCoordinator::HandleReplicaFetch(int from, const peer::ReplicaFetch& f, std::vector<Action>* actions) {
  if (!options_.replicate || from != Predecessor() || from == me_) return;
  actions->push_back([this, from, f] {
    peer::LiveCopy copy = f.copy;
    if (f.newest) {  // the newest restorable kept here, if newer than the fetcher's (else: none)
      std::vector<peer::LiveCopy> own, held;
      host_.LiveCopies(&own, &held);
      std::optional<peer::LiveCopy> answer;
      {
        MutexLock lock(&mu_);
        answer = NewestFetchAnswerLocked(from, copy, held);
      }
      if (!answer) return SendCopy(from, f.epoch, from, copy, /*restore=*/true, nullptr);
      copy = *answer;
    }
    SendCopy(from, f.epoch, from, copy, /*restore=*/true, host_.SerializedCopy(from, copy));
  });
}

// --- async/ssp: copies on arrival ---------------------------------------------------------------

void ClusterCoordinator::AfterReplicated(uint64_t epoch, std::function<void(const Status&)> done) {
  bool waits = false, start = false;
  {
    MutexLock lock(&mu_);
    if (!stopped_ && epoch == epoch_ && epoch == restore_epoch_) {
      MarkServedLocked(me_, epoch, options_.stand_in);  // it took a push: this epoch serves its part
      arrival_waiters_.push_back({arrival_copies_, std::move(done)});
      waits = true;
      start = !arrival_copying_;
      arrival_copying_ = true;
    }
  }
  if (!waits) {
    return done(Unavailable("shard " + std::to_string(me_) +
                            " re-formed before its copy of this change was kept by the next shard; pull and go on"));
  }
  if (start) StartArrivalCopy(epoch);
}

void ClusterCoordinator::StartArrivalCopy(uint64_t epoch) {
  uint64_t generation = 0;
  std::optional<peer::LiveCopy> base;
  {
    MutexLock lock(&mu_);
    if (stopped_ || epoch != epoch_ || epoch != restore_epoch_) return;  // the waiters were answered
    // Every waiter registered so far applied its change before this: the snapshot taken now holds it.
    generation = ++arrival_copies_;
    base = CopyBaseLocked(epoch, epoch);  // copies on arrival are of the epoch's own lineage
  }
  host_.KeepCopyNowAsync(
      epoch, base,
      [this, epoch, generation](std::optional<peer::LiveCopy> copy, std::shared_ptr<const peer::CopyBytes> bytes) {
        std::vector<Action> actions;
        std::shared_ptr<CopyStream> stream;
        {
          MutexLock lock(&mu_);
          // A copy the waiters it covered no longer wait for (answered meanwhile; a newer one began).
          if (stopped_ || epoch != epoch_ || epoch != restore_epoch_ || generation != arrival_copies_) return;
          if (!copy || !bytes) {
            FailArrivalWaitersLocked(Unavailable("shard " + std::to_string(me_) +
                                                 " could not copy its part for the next shard; pull and go on"),
                                     &actions);
          } else {
            PendingAck pending;  // no reply: its ack answers the waiters
            pending.epoch = epoch;
            pending.copy = *copy;
            pending.bytes = bytes;
            pending.sent = now_();
            pending.generation = generation;
            stream = AwaitAckLocked(std::move(pending));
          }
          ToLaneLocked(&actions);
        }
        RunActions(&actions);
        if (copy && bytes) SendCopy(Successor(), epoch, me_, *copy, /*restore=*/false, bytes, false, stream);
      });
}

void ClusterCoordinator::FailArrivalWaitersLocked(const Status& why, std::vector<Action>* actions) {
  arrival_copying_ = false;
  if (ack_ && ack_->to < 0) DropAckLocked();
  if (arrival_waiters_.empty()) return;
  std::vector<ArrivalWaiter> waiters = std::move(arrival_waiters_);
  arrival_waiters_.clear();
  actions->push_back([waiters = std::move(waiters), why] {
    for (const auto& w : waiters) w.done(why);
  });
}

bool ClusterCoordinator::EveryPartCopiedLocked() const {
  for (int k = 0; k < shards_; ++k) {
    // Part k is kept by shard k and by shard k + 1.
    if (OwnCopiesLocked(k).empty() && HeldCopiesLocked((k + 1) % shards_).empty()) return false;
  }
  return true;
}

bool ClusterCoordinator::AnyCopyHeardLocked() const {
  bool any = !own_copies_.empty() || !held_copies_.empty();
  for (const Peer& p : peers_) any = any || !p.own_copies.empty() || !p.held_copies.empty();
  return any;
}

peer::LiveCopy ClusterCoordinator::NewestOwnStateLocked() const {
  peer::LiveCopy newest = accepted_;
  for (const peer::LiveCopy& c : own_copies_) newest = std::max(newest, c);
  return newest;
}

bool ClusterCoordinator::CopiesOfThisTermLocked() const {
  for (int i = 0; i < shards_; ++i) {
    if (i != me_ && peers_[static_cast<size_t>(i)].term < term_) return false;
  }
  return true;
}

void ClusterCoordinator::HeardLocked(int part, const peer::LiveCopy& copy) {
  if (!options_.applies_on_arrival || !options_.replicate || part < 0 || part >= shards_) return;
  if (newest_heard_.size() != static_cast<size_t>(shards_)) newest_heard_.assign(static_cast<size_t>(shards_), {0, -1});
  newest_heard_[static_cast<size_t>(part)] = std::max(newest_heard_[static_cast<size_t>(part)], copy);
}

void ClusterCoordinator::HearCopiesLocked(int k, const std::vector<peer::LiveCopy>& told) {
  // What it heard (passed on: a chief cut off while a stand-in kept a part's newest copies learns
  // of them from the shards that heard it).
  for (size_t i = 0; i < told.size(); ++i) HeardLocked(static_cast<int>(i), told[i]);
  // Only the copies the next shard keeps: an acknowledged push is in one of those. (A shard's own
  // newest copy may still be on its way there, and acknowledges nothing yet.)
  for (const peer::LiveCopy& c : HeldCopiesLocked(k)) HeardLocked((k + shards_ - 1) % shards_, c);
}

StandInLeft ClusterCoordinator::Leaving() const {
  StandInLeft left;
  if (!options_.replicate) return left;
  std::vector<peer::LiveCopy> own, held;
  host_.LiveCopies(&own, &held);
  for (const peer::LiveCopy& c : held) left.held.emplace_back(c, host_.SerializedCopy(Predecessor(), c));
  if (!options_.applies_on_arrival) return left;
  MutexLock lock(&mu_);
  left.kept = newest_heard_;
  left.kept.resize(static_cast<size_t>(shards_), {0, -1});
  for (const peer::LiveCopy& c : held) {
    left.kept[static_cast<size_t>(Predecessor())] = std::max(left.kept[static_cast<size_t>(Predecessor())], c);
  }
  return left;
}

bool ClusterCoordinator::NewestBehindLocked() const {
  for (int k = 0; k < shards_ && static_cast<size_t>(k) < newest_heard_.size(); ++k) {
    peer::LiveCopy kept{0, -1};
    for (const peer::LiveCopy& c : OwnCopiesLocked(k)) kept = std::max(kept, c);
    for (const peer::LiveCopy& c : HeldCopiesLocked((k + 1) % shards_)) kept = std::max(kept, c);
    if (kept < newest_heard_[static_cast<size_t>(k)]) return true;
  }
  return false;
}

void ClusterCoordinator::StartNewestRestoreLocked(uint64_t epoch, std::vector<Action>* actions) {
  // Which copies this shard keeps now (one may have come since the last tick): its own newest is
  // restored unless the next shard keeps a newer one (a stand-in served this part meanwhile), which
  // it is asked for either way.
  actions->push_back([this, epoch] {
    std::vector<peer::LiveCopy> own, held;
    host_.LiveCopies(&own, &held);
    peer::Message fetch;
    {
      MutexLock lock(&mu_);
      if (stopped_ || restore_epoch_ != epoch) return;
      // Its own newest restorable copy. None: the next shard is asked for any copy it keeps, and
      // this shard's own newest is restored if it keeps none.
      peer::LiveCopy have{0, -1};
      for (const peer::LiveCopy& c : own) {
        if (RestorableLocked(me_, c)) {
          have = c;
          break;
        }
      }
      fetch_fallback_.reset();
      if (have.step < 0 && !own.empty()) fetch_fallback_ = own.front();
      live_restores_[epoch] = have;  // the copy restored, once known
      while (live_restores_.size() > 8) live_restores_.erase(live_restores_.begin());
      fetch_.emplace(epoch, have);
      fetch_newest_ = true;
      fetch_sent_ = now_();
      fetch = MessageLocked(peer::ReplicaFetch{epoch, have, /*newest=*/true});
    }
    SendTo(Successor(), fetch);
  });
}

void ClusterCoordinator::MarkServedLocked(int part, uint64_t epoch, bool stand_in) {
  if (!options_.applies_on_arrival || !options_.replicate || part < 0 || part >= shards_) return;
  served_.resize(static_cast<size_t>(shards_));  // (as HearServedLocked; no vector per push)
  auto& served = served_[static_cast<size_t>(part)];
  served = std::max(served, peer::PartServed{epoch, stand_in});
}

void ClusterCoordinator::NotePredecessorCopyLocked(int from, const peer::ReplicaChunk& c) {
  if (!options_.applies_on_arrival) return;
  if (c.copy.lineage == c.epoch) {
    // A copy taken on arrival (or a restore's from a checkpoint) in this shard's epoch: that epoch
    // serves the predecessor's part (a push acknowledged on it is in this copy).
    if (c.epoch == restore_epoch_) {
      MarkServedLocked(from, c.epoch, AddressOf(from) != options_.addresses[static_cast<size_t>(from)]);
    }
    return;
  }
  // The copy the predecessor restored for epoch c.epoch (a formation from live copies keeps their
  // lineage). Counted once this shard took that epoch's order too: a copy of an epoch formed on
  // the other side of a partition, which never ran here, tells nothing of what was passed over.
  if (c.epoch > restore_epoch_) {
    if (!pending_restore_ || pending_restore_->first <= c.epoch) pending_restore_.emplace(c.epoch, c.copy);
    return;
  }
  NoteRestoredLocked(from, c.epoch, c.copy);
}

void ClusterCoordinator::NoteRestoredLocked(int part, uint64_t epoch, const peer::LiveCopy& copy) {
  if (!options_.applies_on_arrival) return;
  auto it = restored_copy_.find(part);
  if (it == restored_copy_.end() || it->second.first <= epoch) restored_copy_[part] = {epoch, copy};
}

void ClusterCoordinator::TookRestoreOrderLocked() {
  if (!pending_restore_ || pending_restore_->first > restore_epoch_) return;
  if (pending_restore_->first == restore_epoch_) {
    NoteRestoredLocked(Predecessor(), pending_restore_->first, pending_restore_->second);
  }
  pending_restore_.reset();
}

bool ClusterCoordinator::RestorableLocked(int part, const peer::LiveCopy& copy) const {
  if (copy.step < 0) return false;
  // Of an epoch newer than the newest known to have served the part: formed elsewhere (the other
  // side of a partition) and never run. It holds what that formation restored; the part's copies
  // of the epochs that served hold the pushes acknowledged since. (Its lineage would order it
  // above them.)
  const size_t k = static_cast<size_t>(part);
  if (k < served_.size() && served_[k].epoch > 0 && copy.lineage > served_[k].epoch) return false;
  // Newer than the copy a later formation restored for the part, and of an older lineage: passed
  // over then (not restorable then, as above), it stays so.
  if (auto it = restored_copy_.find(part); it != restored_copy_.end()) {
    const auto& [epoch, restored] = it->second;
    if (copy.lineage < epoch && restored < copy) return false;
  }
  return true;
}

std::optional<peer::LiveCopy> ClusterCoordinator::NewestFetchAnswerLocked(
    int part, const peer::LiveCopy& have, const std::vector<peer::LiveCopy>& held) const {
  // The fetcher's own copy is judged there (it knows best which epochs served its part: it took
  // their pushes); the copies kept here, here.
  std::optional<peer::LiveCopy> newest;
  for (const peer::LiveCopy& c : held) {  // newest first
    if (RestorableLocked(part, c)) {
      newest = c;
      break;
    }
  }
  if (!newest && !held.empty()) newest = held.front();  // none restorable: the newest, as before
  if (newest && have < *newest) return newest;
  return std::nullopt;
}

bool ClusterCoordinator::ServedPastLocked(const peer::Restore& r) const {
  if (!r.live || r.newest || epoch_ <= r.lineage) return false;
  // Steps released in this shard's epoch (known_released_: the tokens the chief pushed, a commit
  // a follower took, the chief's heartbeats; not the step a formation started at, which one that
  // never ran did not release), whether or not that epoch still runs: a chief that moved a shard
  // stopped running it, yet those steps stay released (seed 1234307: such a chief took a late
  // order of a term formed on the other side of a partition, and dropped its copies of the
  // released steps; seed 1334512: a follower, whose own copies as of its last tick showed less).
  if (known_released_.lineage == epoch_ && known_released_.step > r.step) return true;
  if (chief_ == me_) return false;
  // A follower: its own copy of step s in its epoch means every shard committed s - 1, and the
  // tokens of step s - 1 went out.
  for (const peer::LiveCopy& c : own_copies_) {
    if (c.lineage == epoch_ && c.step > r.step + 1) return true;
  }
  return false;
}

}  // namespace psd::server
