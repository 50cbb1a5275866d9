// WorkerSession: the distribution-aware primitives' requests (reduce_to, update), parked until
// their round completes or their deadline passes.
#include <spdlog/spdlog.h>

#include <atomic>

#include "service/reply_values.h"
#include "service/service_host.h"
#include "service/worker_session.h"

namespace psd::server {

void WorkerSession::ArmDeadline(int64_t timeout_ms, const std::shared_ptr<ParkedReply>& reply,
                                std::function<void()> expire) {
  timeout_ms = WaitMs(timeout_ms);
  // Answered ones leave here too: Busy() prunes them only where --idle-timeout-s asks it.
  std::erase_if(collectives_, [](const auto& c) { return c->answered(); });
  if (conn_->closed()) return;  // closed meanwhile: nobody to answer, nothing to park
  collectives_.insert(reply);   // not idle while it is parked
  ParkedReply::ArmDeadline(reply, std::chrono::milliseconds(timeout_ms), std::move(expire));
}

void WorkerSession::HandleReduce(uint64_t id, proto::Reduce::Reader r) {
  auto engine = host_.engine();
  std::vector<GradRef> values;
  for (auto e : r.getEntries()) {
    auto t = wire::ReadTensor(e.getValue(), host_.config().max_frame_bytes);
    if (!t.ok()) return SendError(id, t.status());
    auto name = e.getDestination();
    values.push_back({std::string_view(name.cStr(), name.size()), t->dtype, std::move(t->shape), t->data, t->bytes});
  }
  if (values.empty()) return SendError(id, InvalidArgument("reduce_to needs at least one value"));
  // The reply is built when every destination's round completed, or at the deadline; whichever
  // comes first answers, on this connection's strand.
  auto parked = std::make_shared<ParkedReply>(conn_->strand());
  int64_t timeout_ms = WaitMs(r.getTimeoutMs());
  auto self = shared_from_this();
  auto completed = std::make_shared<std::atomic<bool>>(false);
  // The engine keeps `reply` until the round completes: it must not hold the engine (a cycle that
  // would keep an engine replaced by a restore, and this session, alive).
  // Async/ssp with replicas: the new values are acknowledged once the next shard keeps them.
  auto reply = [self, id, parked, completed, copies = CopiesOnArrival(),
                epoch = engine->epoch()](std::vector<ReduceOutcome> outcomes) {
    completed->store(true);
    asio::post(self->conn_->strand(), [self, id, parked, copies, epoch, outcomes = std::move(outcomes)]() mutable {
      if (!parked->Answer()) return;
      self->AnswerPosted(id, [&] {
        auto answer = [self, id, outcomes = std::move(outcomes)](const Status& copied) {
          if (!copied.ok()) return self->SendError(id, copied);
          proto::Response::Builder resp(nullptr);
          auto frame = self->NewReply(id, &resp);
          auto list = resp.initReduce().initResults(static_cast<unsigned>(outcomes.size()));
          for (size_t i = 0; i < outcomes.size(); ++i) {
            const ReduceOutcome& o = outcomes[i];
            auto e = list[static_cast<unsigned>(i)];
            e.setAccepted(o.accepted);
            e.setStep(o.step);
            SetValue(*frame, e.initValue(), o.value, o.dtype, o.shape, o.declared);
          }
          self->Send(std::move(frame));
        };
        if (copies) return self->AfterCopy(id, epoch, std::move(answer));
        answer(Status::Ok());
      });
    });
  };
  // The sender, as this shard's registry numbers it: a retry of a round is not counted twice.
  const int64_t replica = conn_->role() == Connection::Role::kWorker ? static_cast<int64_t>(worker_index_) : -1;
  Status s = engine->Reduce(r.getOp() == proto::Reduction::MEAN, r.getLocalStep(), values, std::move(reply), replica);
  if (!s.ok()) {
    parked->Answer();
    return SendError(id, s);
  }
  if (completed->load()) return;  // answered already (the last contribution, or all stale)
  ArmDeadline(timeout_ms, parked, [self, id, timeout_ms, engine] {
    self->AnswerPosted(id, [&] {
      self->SendError(
          id, DeadlineExceeded(
                  "reduce_to: not every replica contributed within " + std::to_string(timeout_ms) +
                  " ms (a round needs " + std::to_string(engine->required_replicas()) +
                  "); this call's values still count (a retry waits for their round without counting them again)"));
    });
  });
}

void WorkerSession::HandleUpdate(uint64_t id, proto::Update::Reader r) {
  auto engine = host_.engine();
  UpdateArgs a;
  auto name = r.getVariable();
  a.name = std::string_view(name.cStr(), name.size());
  switch (r.getOp()) {
    case proto::UpdateOp::ASSIGN:
      a.op = UpdateOp::kAssign;
      break;
    case proto::UpdateOp::ASSIGN_ADD:
      a.op = UpdateOp::kAssignAdd;
      break;
    case proto::UpdateOp::ASSIGN_SUB:
      a.op = UpdateOp::kAssignSub;
      break;
    case proto::UpdateOp::SCALE:
      a.op = UpdateOp::kScale;
      break;
    default:
      return SendError(id, InvalidArgument("unknown update op"));
  }
  std::optional<PendingValue> gathered;  // a value that came in chunks (kept until the engine took it)
  if (!r.getChunked()) pending_value_.reset();
  if (a.op != UpdateOp::kScale) {
    auto t = wire::ReadTensor(r.getValue(), host_.config().max_frame_bytes);
    if (!t.ok()) {
      pending_value_.reset();
      return SendError(id, t.status());
    }
    if (r.getChunked()) {
      gathered = TakeChunk(id, proto::Request::UPDATE, std::string(a.name), r.getChunkOffset(), r.getChunkedShape(),
                           r.getMore(), &*t);
      if (!gathered) return;
    }
    a.dtype = t->dtype;
    a.shape = std::move(t->shape);
    a.data = t->data;
    a.bytes = t->bytes;
  } else if (r.getChunked()) {
    return SendError(id, InvalidArgument("update '" + std::string(a.name) + "': a scale has no value to chunk"));
  }
  a.factor = r.getFactor();
  a.cross_replica = r.getCrossReplica();
  // A single daemon knows the sender's replica from its hello; a cluster's client names the index
  // the chief gave it (this shard's own order of hellos may differ).
  a.replica =
      host_.coordinator() == nullptr && conn_->role() == Connection::Role::kWorker ? worker_index_ : r.getReplica();
  a.local_step = r.getLocalStep();
  a.at_next_step = r.getAtNextStep();
  // The sender, as this shard numbers it: a retry of a round is not counted twice.
  a.sender = conn_->role() == Connection::Role::kWorker ? static_cast<int64_t>(worker_index_) : -1;
  auto parked = std::make_shared<ParkedReply>(conn_->strand());
  auto completed = std::make_shared<std::atomic<bool>>(false);
  auto self = shared_from_this();
  // Async/ssp with replicas: an applied update is acknowledged once the next shard keeps it.
  const bool copies = CopiesOnArrival();
  const uint64_t epoch = engine->epoch();
  Status s =
      engine->Update(a, [self, id, parked, completed, copies, epoch](const Status& st, bool applied, int64_t step) {
        completed->store(true);
        asio::post(self->conn_->strand(), [self, id, parked, st, applied, step, copies, epoch] {
          if (!parked->Answer()) return;
          self->AnswerPosted(id, [&] {
            if (!st.ok()) return self->SendError(id, st);
            auto answer = [self, id, applied, step](const Status& copied) {
              if (!copied.ok()) return self->SendError(id, copied);
              proto::Response::Builder resp(nullptr);
              auto frame = self->NewReply(id, &resp);
              auto u = resp.initUpdate();
              u.setApplied(applied);
              u.setStep(step);
              self->Send(std::move(frame));
            };
            if (copies && applied) return self->AfterCopy(id, epoch, answer);
            answer(Status::Ok());
          });
        });
      });
  if (!s.ok()) {
    parked->Answer();
    return SendError(id, s);
  }
  if (completed->load()) return;
  int64_t timeout_ms = WaitMs(r.getTimeoutMs());
  ArmDeadline(timeout_ms, parked, [self, id, timeout_ms] {
    self->AnswerPosted(id, [&] {
      self->SendError(id, DeadlineExceeded("update: not every replica assigned within " + std::to_string(timeout_ms) +
                                           " ms; this replica's share still counts"));
    });
  });
}

}  // namespace psd::server
