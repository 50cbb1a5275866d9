// WorkerSession: a worker's pushes (gradients of any size, in one frame or several, through
// shared memory or TCP), the token wait they may carry, and plain token waits.
#include <spdlog/spdlog.h>

#include <utility>
#include <vector>

#include "cluster/coordinator.h"
#include "service/reply_values.h"
#include "service/service_host.h"
#include "service/worker_session.h"

namespace psd::server {
namespace {

const int64_t kNoIndex = 0;  // a valid pointer for sparse gradients with no rows

// The undo of a reply that carries `token` (when `st` is OK), run if the reply is never written
// whole (it waits for memory and the connection closes, or the connection drops it queued or cut
// off): a sync token goes back to the queue, as FinishTokenWait gives back one delivered to a
// worker that is gone. Empty where there is nothing to give back (async and bounded staleness have
// no queue).
std::function<void()> GiveBack(const Status& st, Mode mode, std::shared_ptr<TrainingEngine> engine, int64_t token) {
  if (!st.ok() || mode != Mode::kSync) return nullptr;
  return [engine = std::move(engine), token] { engine->tokens().PushFront(token); };
}

}  // namespace

void WorkerSession::HandlePush(uint64_t id, proto::Push::Reader r) {
  const bool more = r.getMore();
  // The rest of a push one of whose frames was refused is refused too, up to its last frame: none
  // of it counts (a sparse gradient's rows so far, and in deterministic mode a dense gradient's
  // chunks, went at the refusal; in the default mode the chunks added stay, as a cut-off push's).
  // Else its later frames would count as a push of their own: a gradient without its first rows.
  if (push_refused_) {
    if (!more) push_refused_ = false;
    return SendError(id, InvalidArgument("an earlier frame of this push was refused, so the rest of it is too: "
                                         "fix what that frame's error says and send the push again"));
  }
  // A frame with more to come that is refused (on any way out below) ends its push so.
  struct Refusal {
    WorkerSession* session;
    bool more;
    bool accepted = false;
    ~Refusal() {
      if (accepted || !more) return;
      session->push_refused_ = true;
      session->host_.engine()->DropUnfinishedChunks(session->id_);
      session->push_unfinished_ = false;
    }
  } refusal{this, more};
  // The rows so far of sparse gradients this frame continues; kept again below only if it is
  // taken with more frames to come (a frame refused on any way out ends the push).
  auto continuing = std::move(sparse_rows_last_);
  sparse_rows_last_.clear();
  // A new push while this connection's last one never ended (its last frame was refused): its
  // sparse gradients' rows so far, and its chunks' slots in deterministic mode, go (the engine's
  // DropUnfinishedChunks).
  if (!in_push_ && push_unfinished_) {
    host_.engine()->DropUnfinishedChunks(id_);
    push_unfinished_ = false;
  }
  in_push_ = false;  // until this frame is taken with more to come
  auto grads_in = r.getGrads();
  ClusterCoordinator* const cluster = host_.coordinator();
  // Async/ssp on a cluster, a worker's push reaches the chief even with nothing for it: it
  // counts the worker's step there (the cluster's global step, coordinator.h).
  const bool counts_only = cluster != nullptr && host_.config().mode != Mode::kSync && !r.getMore();
  if (grads_in.size() == 0 && !counts_only) return SendError(id, InvalidArgument("Must supply at least one variable"));
  if (grads_in.size() == 0 && !cluster->is_chief()) {
    return SendError(
        id, Unavailable("the global step lives on the chief shard " + std::to_string(cluster->chief()) + "; retry"));
  }
  auto engine = host_.engine();
  if (ClusterCoordinator* c = cluster) {
    uint64_t epoch = r.getClusterEpoch();
    if (epoch != 0 && epoch != engine->epoch()) {
      return SendError(id, Aborted("gradients computed at cluster epoch " + std::to_string(epoch) +
                                   "; the cluster re-formed since (from a checkpoint or its live copies) and runs "
                                   "epoch " +
                                   std::to_string(engine->epoch()) + ": pull the variables and go on from there"));
    }
    if (r.getWaitToken() && !c->is_chief()) {
      return SendError(id, Unavailable("tokens live on the chief shard " + std::to_string(c->chief()) + "; retry"));
    }
  }
  std::vector<GradRef> grads;
  grads.reserve(grads_in.size());
  // Held gradients pay off when the worker is answered after the step's take (its push waits
  // for the token): a push answered sooner has them copied before its answer, one step behind the
  // adds. A push's frames with more to come do not say: as this worker's last push did.
  const bool hold = host_.config().mode == Mode::kSync && (r.getMore() ? pushes_wait_ : r.getWaitToken());
  if (!r.getMore()) pushes_wait_ = r.getWaitToken();
  // Sparse indices, at stable addresses (a moved vector keeps its elements where they are); empty,
  // it allocates nothing (a deque would, for every dense push).
  std::vector<std::vector<int64_t>> index_storage;
  ShmSlot::Lease shm_lease;  // shared memory, while the gradients are read
  for (auto g : grads_in) {
    auto t = ReadTensorIn(g.getGrad(), &shm_lease);
    if (!t.ok()) return SendError(id, t.status());
    auto name = g.getName();
    GradRef ref{std::string_view(name.cStr(), name.size()),
                t->dtype,
                std::move(t->shape),
                t->data,
                t->bytes,
                nullptr,
                0,
                std::nullopt};
    if (g.getChunk()) {
      if (g.getChunkOffset() < 0) return SendError(id, InvalidArgument("a gradient chunk's offset must be >= 0"));
      ref.chunk_offset = g.getChunkOffset();
      ref.source = id_;
    }
    ref.rows_more = g.getRowsMore();  // the engine checks it is a sparse gradient's, with more frames
    // A dense gradient in the worker's own segment (not its shared buffers, which it may revoke)
    // stays as it is until the worker is answered: the accumulator may point at it (held_).
    if (hold && g.getGrad().getInShm() && g.getGrad().getShmSegment() == 0 && !g.getSparse()) {
      if (!held_) {
        held_ = std::make_shared<std::shared_ptr<wire::SharedSegment>>(shm_lease.shared_segment(0));
        held_engine_ = engine;
      }
      ref.hold = held_;
    }
    if (g.getSparse()) {
      // Copied out of the message: a peer may encode the list with another element size.
      auto idx = g.getIndices();
      index_storage.emplace_back(idx.size());
      for (unsigned k = 0; k < idx.size(); ++k) index_storage.back()[k] = idx[k];
      ref.nnz = idx.size();
      ref.indices = idx.size() ? index_storage.back().data() : &kNoIndex;
      ref.source = id_;  // a gradient sent in several frames is kept apart until its last rows
      if (g.getHasDenseShape()) {
        Shape ds;
        for (int64_t d : g.getDenseShape()) ds.push_back(d);
        if (ds.size() > 32) return SendError(id, InvalidArgument("dense_shape rank exceeds 32"));
        ref.dense_shape = std::move(ds);
      }
    }
    grads.push_back(std::move(ref));
  }
  if (more && (r.getWaitToken() || r.getPullAfter().size() > 0)) {
    return SendError(id, InvalidArgument("a push frame with `more` set cannot wait for a token or pull: only the "
                                         "last frame of a push does"));
  }
  // A sparse gradient sent in several frames (rowsMore): its rows keep increasing from frame to
  // frame, as within one (a row sent twice would count twice).
  for (const GradRef& g : grads) {
    auto it = continuing.find(g.name);
    if (it != continuing.end() && g.nnz > 0 && g.indices[0] <= it->second) {
      return SendError(id, InvalidArgument("gradient for '" + std::string(g.name) + "': its rows continue at index " +
                                           std::to_string(g.indices[0]) + ", not after the last frame's " +
                                           std::to_string(it->second) +
                                           "; a sparse gradient's indices must keep increasing across frames"));
    }
  }
  if (!more) {
    // The push's last frame ends every gradient an earlier frame began (rowsMore): rows left
    // unfinished would never count.
    for (const auto& [name, last_row] : continuing) {
      bool ends = false;
      for (const GradRef& g : grads) ends = ends || (g.name == name && !g.rows_more);
      if (!ends) {
        return SendError(id, InvalidArgument("gradient for '" + name +
                                             "': an earlier frame of this push sent some of its rows (rowsMore) "
                                             "and the push's last frame does not end it; send its last rows, "
                                             "without rowsMore, in the last frame"));
      }
    }
  }
  std::vector<std::string> pull_after;
  for (auto n : r.getPullAfter()) pull_after.emplace_back(n);
  auto want = WantedDTypes(r.getPullAfterDtypes(), pull_after.size());
  if (!want.ok()) return SendError(id, want.status());
  if (!pull_after.empty()) {
    // Checked before anything is pushed, so the pull after the token cannot fail (variables are
    // never deleted) and a bad name changes nothing.
    auto declared = engine->DeclaredDTypes(pull_after);
    Status known = declared.status();
    for (size_t i = 0; known.ok() && i < declared->size(); ++i) {
      if ((*want)[i]) known = CheckWanted(pull_after[i], (*declared)[i], *(*want)[i]);
    }
    if (!known.ok()) return SendError(id, known);
  }
  // A sync push that waits parks its wait before the gradients are applied: when they complete a
  // step, the step's tokens go to the waiters parked at that moment, this one included, so a fast
  // worker's next push cannot take the token this worker is owed (two back-to-back waits of
  // one worker would otherwise leave the other without a token until its wait timed out).
  struct Pending {
    bool failed = false;  // the push was refused: the wait answers nothing (a token goes back)
    std::vector<GradOutcome> outcomes;
    std::vector<std::string> pull_after;            // the values the reply carries too
    std::vector<std::optional<DType>> pull_dtypes;  // ... and the dtypes they are asked in
    std::optional<ShmTarget> pull_shm;              // ... and where, when in shared memory
    // The engine pushed to, for the answer. The closures below reach it through `pending` rather
    // than each holding a copy: every copy of a shared_ptr to the engine counts on one cache line
    // that all I/O threads write, and a sync push's closures are copied several times.
    std::shared_ptr<TrainingEngine> engine;
  };
  auto pending = std::make_shared<Pending>();
  pending->engine = engine;
  pending->pull_after = std::move(pull_after);
  pending->pull_dtypes = std::move(*want);
  pending->pull_shm = TargetOf(r.hasPullToShm(), r.getPullToShm());
  auto fill = [pending, this](proto::PushReply::Builder p) {
    TrainingEngine* engine = pending->engine.get();
    const std::vector<GradOutcome>& outcomes = pending->outcomes;
    auto results = p.initResults(static_cast<unsigned>(outcomes.size()));
    for (size_t i = 0; i < outcomes.size(); ++i) {
      results[static_cast<unsigned>(i)].setAccepted(outcomes[i].accepted);
      results[static_cast<unsigned>(i)].setStep(outcomes[i].step);
      results[static_cast<unsigned>(i)].setStaleness(outcomes[i].staleness);
    }
    p.setIsChief(host_.workers().IsChief(id_));
    p.setStepGradients(engine->last_step_gradients());
    FillCluster(p, engine->epoch());
  };
  // Values pulled with the push into the worker's own segment: written once what psd still reads
  // there is copied (WhenSettled).
  const bool into_segment = pending->pull_shm && pending->pull_shm->segment == 0;
  auto answer_now = [this, id, pending, fill](const Status& st, int64_t token) {
    proto::Response::Builder resp(nullptr);
    auto frame = NewReply(id, &resp);
    auto p = resp.initPush();
    fill(p);
    p.setToken(token);
    p.setTokenCode(wire::ToWire(st.code()));
    p.setTokenMessage(st.message());
    if (st.ok() && !pending->pull_after.empty()) {
      Status pulled =
          AddValues(*frame, p.initPulled(), pending->pull_after, false, pending->pull_dtypes, {}, pending->pull_shm);
      if (!pulled.ok()) return SendError(id, pulled);  // unreachable: the names were checked
    }
    // A token in a reply never sent (it waited for memory, and the connection closed) goes back.
    Send(std::move(frame), false, GiveBack(st, host_.config().mode, pending->engine, token));
  };
  auto answer = [this, pending, answer_now, into_segment](const Status& st, int64_t token) {
    if (pending->failed) {
      if (st.ok()) pending->engine->tokens().PushFront(token);  // not this worker's: the push was refused
      return;
    }
    if (!st.ok() || pending->pull_after.empty() || !into_segment) return answer_now(st, token);
    WhenSettled([answer_now, st, token] { answer_now(st, token); },
                GiveBack(st, host_.config().mode, pending->engine, token));
  };
  const bool wait_first = r.getWaitToken() && host_.config().mode == Mode::kSync;
  std::shared_ptr<TokenWait> parked;
  // The answer runs on this strand, after this handler: the outcomes are in by then.
  if (wait_first) parked = WaitForToken(r.getTimeoutMs(), answer, r.getLocalStep());
  // Set first: a push that fails (or throws) after keeping some of its rows apart lets them go at
  // the connection's close or its next push.
  if (more) push_unfinished_ = true;
  Status s = engine->Push(r.getLocalStep(), grads, &pending->outcomes, worker_name_, more);
  if (more && s.ok()) {
    for (const GradRef& g : grads) {
      if (!g.rows_more) {
        continuing.erase(std::string(g.name));
      } else if (g.nnz > 0) {
        continuing[std::string(g.name)] = g.indices[g.nnz - 1];
      } else {
        continuing.try_emplace(std::string(g.name), -1);  // begun, no rows yet
      }
    }
    sparse_rows_last_ = std::move(continuing);
    in_push_ = true;
    push_unfinished_ = true;
  }
  if (!more && s.ok()) push_unfinished_ = false;  // its last frame: every chunk came
  if (!s.ok()) {
    pending->failed = true;
    if (parked) parked->cancel(Cancelled("the push was refused"));
    return SendError(id, s);
  }
  refusal.accepted = true;
  if (!more) {  // a push sent in several frames counts once, at its last
    int accepted = 0;
    int64_t staleness = 0;
    for (const GradOutcome& o : pending->outcomes) {
      accepted += o.accepted ? 1 : 0;
      staleness = std::max(staleness, o.staleness);
    }
    host_.metrics().OnPush(worker_index_, r.getLocalStep(), accepted,
                           static_cast<int>(pending->outcomes.size()) - accepted, staleness);
  }
  if (wait_first) return;
  auto reply = [this, id, pending, fill, answer, more, into_segment, wait_token = r.getWaitToken(),
                timeout_ms = r.getTimeoutMs()] {
    if (wait_token) {
      WaitForToken(timeout_ms, answer);
      return;
    }
    auto reply_now = [this, id, pending, fill, more] {
      proto::Response::Builder resp(nullptr);
      auto frame = NewReply(id, &resp);
      auto p = resp.initPush();
      fill(p);
      if (!pending->pull_after.empty()) {
        Status pulled =
            AddValues(*frame, p.initPulled(), pending->pull_after, false, pending->pull_dtypes, {}, pending->pull_shm);
        if (!pulled.ok()) return SendError(id, pulled);
      }
      Send(std::move(frame), /*keep_held=*/more);  // a frame with more to come: the call goes on
    };
    if (pending->pull_after.empty() || !into_segment) return reply_now();
    WhenSettled(std::move(reply_now));
  };
  // Async/ssp with replicas: a push is acknowledged once the next shard keeps a copy of this part
  // that holds it (a push in several frames: at its last), so no acknowledged push is lost with
  // this shard (cluster/replication.cc).
  if (more || !CopiesOnArrival()) return reply();
  AfterCopy(id, engine->epoch(), [this, id, reply](const Status& st) {
    if (!st.ok()) return SendError(id, st);
    reply();
  });
}

bool WorkerSession::CopiesOnArrival() const {
  return host_.coordinator() != nullptr && host_.config().mode != Mode::kSync && host_.config().replicas_per_shard > 1;
}

void WorkerSession::AfterCopy(uint64_t id, uint64_t epoch, std::function<void(const Status&)> then) {
  auto self = shared_from_this();
  // Waiting: counted in awaiting_copies_ until the copy's answer runs, or this call throws (out of
  // memory): then the request is answered by whoever catches it, and a copy's answer that comes
  // anyway (registered before the throw) does nothing. Both run on the strand.
  auto waiting = std::make_shared<bool>(true);
  ++awaiting_copies_;
  try {
    host_.coordinator()->AfterReplicated(epoch, [self, id, waiting, then = std::move(then)](const Status& st) {
      asio::post(self->conn_->strand(), [self, id, waiting, then, st] {
        if (!std::exchange(*waiting, false)) return;
        --self->awaiting_copies_;
        if (self->conn_->closed()) return;
        self->AnswerPosted(id, [&] { then(st); });
      });
    });
  } catch (...) {
    if (std::exchange(*waiting, false)) --awaiting_copies_;  // the connection may go idle again
    throw;
  }
}

bool WorkerSession::SettleHeld() {
  if (!held_) return true;
  // Only this session makes copies of held_ (on its strand), so a count of one means every
  // accumulator let it go, each after copying what it pointed at.
  if (held_.use_count() > 1) {
    auto current = host_.engine();
    bool copied = current->ResolveHeld();
    // The engine the hold was first given to, if a restored checkpoint has replaced it since: its
    // accumulators may still point at the segment, and pushes into it may still read there.
    if (auto first = held_engine_.lock(); first && first != current && held_.use_count() > 1) {
      copied = first->ResolveHeld() && copied;
    }
    if (!copied) return false;  // the hold stays: what still points at the segment keeps it mapped
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // their copies, before the worker hears
  held_.reset();
  held_engine_.reset();
  return true;
}

void WorkerSession::SendLater(std::shared_ptr<wire::OutFrame> frame, std::function<void()> on_drop) {
  // Sent later, the frame takes its on_drop along: the connection may still drop it unwritten.
  Unsettled({[this, frame = std::move(frame), on_drop]() mutable { conn_->Send(std::move(frame), on_drop); },
             std::move(on_drop)});
}

void WorkerSession::Unsettled(Waiting waiting) {
  // The worker may not write its segment before it is answered, so what psd reads there stays
  // valid meanwhile; a worker whose call times out drops the connection and attaches a new
  // segment (the accumulators' holds keep this one mapped until they let it go).
  bool done_with = false;  // `waiting` is the list's now, or undone: never undone (again) here
  try {
    if (unsettled_.size() >= kMaxUnsettled) {
      spdlog::warn("connection {}: more than {} replies wait for memory; closing", id_, kMaxUnsettled);
      done_with = true;
      conn_->RunOnUnsent(waiting.on_drop);
      return DropUnsettled(/*close=*/true);
    }
    unsettled_.reserve(kMaxUnsettled);
    unsettled_.push_back(std::move(waiting));  // or, out of memory, it changed nothing
    done_with = true;
    if (unsettled_.size() > 1) return;
    spdlog::warn(
        "connection {}: no memory to copy the gradients psd still reads in the worker's shared memory; "
        "its reply waits, tried again every {} ms",
        id_, kSettleRetry.count());
    RetrySettle();
  } catch (const std::exception& e) {  // no memory even for that: the worker is not answered here
    spdlog::error("connection {}: a reply cannot wait for memory ({}); closing", id_, e.what());
    if (!done_with) conn_->RunOnUnsent(waiting.on_drop);
    DropUnsettled(/*close=*/true);
  }
}

void WorkerSession::DropUnsettled(bool close) {
  std::vector<Waiting> dropped;
  dropped.swap(unsettled_);
  if (settle_timer_) settle_timer_->cancel();
  for (auto& w : dropped) conn_->RunOnUnsent(w.on_drop);
  if (close) conn_->CloseNow();
}

void WorkerSession::RetrySettle() {
  if (!settle_timer_) settle_timer_.emplace(conn_->strand());
  settle_timer_->expires_after(kSettleRetry);
  settle_timer_->async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->conn_->closed()) return self->DropUnsettled(/*close=*/false);
    try {
      if (!self->SettleHeld()) return self->RetrySettle();
    } catch (const std::exception& e) {
      spdlog::error("connection {}: replies waiting for memory cannot wait longer ({}); closing", self->id_, e.what());
      return self->DropUnsettled(/*close=*/true);
    }
    // In order; what they send goes out at once (nothing waits before it any more).
    std::vector<Waiting> waiting;
    waiting.swap(self->unsettled_);
    for (auto& w : waiting) {
      if (self->conn_->closed()) {
        self->conn_->RunOnUnsent(w.on_drop);
        continue;
      }
      const uint64_t handed = self->replies_handed_;
      try {
        w.run();
      } catch (const std::exception& e) {
        // No memory for the reply that waited (its frame, its values): unless it was handed over,
        // nothing of it went out, and a token it carries goes back. The connection closes, so the
        // worker's call fails at once (it reconnects) instead of waiting out its deadline, and
        // what waits behind it is dropped the same way.
        spdlog::error("connection {}: a reply that waited for memory failed ({}); closing", self->id_, e.what());
        if (self->replies_handed_ == handed) self->conn_->RunOnUnsent(w.on_drop);
        self->conn_->CloseNow();
      }
    }
  });
}

void WorkerSession::HandleWaitToken(uint64_t id, proto::WaitToken::Reader r) {
  if (ClusterCoordinator* c = host_.coordinator(); c != nullptr && !c->is_chief()) {
    return SendError(id, Unavailable("tokens live on the chief shard " + std::to_string(c->chief()) + "; retry"));
  }
  // The engine whose queue the wait takes its token from (WaitForToken's): a token not delivered
  // goes back there, whatever a restore has put in its place since.
  auto done = [this, id, engine = host_.engine()](const Status& st, int64_t token) {
    if (!st.ok()) return SendError(id, st);
    proto::Response::Builder resp(nullptr);
    auto frame = NewReply(id, &resp);
    auto t = resp.initToken();
    t.setToken(token);
    t.setIsChief(host_.workers().IsChief(id_));
    t.setStepGradients(engine->Stats().last_step_gradients);
    // A token in a reply never written whole goes back.
    Send(std::move(frame), false, GiveBack(st, host_.config().mode, engine, token));
  };
  // A worker whose pushes went to the other shards says their local step (afterStep).
  WaitForToken(r.getTimeoutMs(), done, r.getAfterStep());
}

}  // namespace psd::server
