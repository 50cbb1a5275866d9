// TrainingEngine: the distribution-aware primitives (reduce_to, update) and sync-on-read values.
#include <algorithm>

#include "core/training_engine.h"
#include "core/training_engine_internal.h"

namespace psd::server {

using namespace engine_internal;

// A completed round's waiters and what they are told.
struct TrainingEngine::RoundDone {
  std::vector<Round::Waiter> ready;
  Status outcome;
  int64_t step = 0;
  std::shared_ptr<const Buffer> value;
  void Tell() {
    for (auto& w : ready) w(outcome, step, value);
  }
};

namespace {

// What a sender's value is to a round: the first it gives (counted), its retry of the value
// already in the round (a deadline passed: it waits for the round), or a value of another step
// while its value of this round waits (not counted: one value per sender and round).
enum class Contribution { kNew, kRetry, kOther };

Contribution Classify(const Round& r, int64_t sender, int64_t local_step) {
  if (sender < 0) return Contribution::kNew;
  for (const auto& [who, step] : r.senders) {
    if (who == sender) return step == local_step ? Contribution::kRetry : Contribution::kOther;
  }
  return Contribution::kNew;
}

// Ends a completed round: returns its step (told to its waiters) and sets the next one's.
int64_t FinishRound(Round* r, bool sync) {
  // Sync: the round is of the step its values were tagged with (the global step), and a value of
  // that step or an older one, late, is stale — also where a destination is reduced every few
  // steps (a count of rounds would lag behind it). Async/ssp: the workers' steps differ by design,
  // so a round is numbered by its count, as before, and a lagging worker's value still counts.
  const int64_t step = sync ? std::max(r->step, r->newest) : r->step;
  r->step = step + 1;
  r->count = 0;
  r->newest = -1;
  r->senders.clear();
  return step;
}

Status MixedOps(const std::string& name, bool round_mean) {
  return InvalidArgument("reduce_to '" + name + "': this round is a " + (round_mean ? "MEAN" : "SUM") +
                         " (its first value asked so); every replica's value of a round must ask the same op");
}

}  // namespace

std::shared_ptr<Buffer> TrainingEngine::ReadValueLocked(Variable* v) {
  if (!v->sync_on_read) {
    AwaitInPlaceWriteLocked(v);
    return v->published;
  }
  // Every replica a worker may update as its own: the job's worker slots (max(N, R)), as Update,
  // the snapshot and the memory cost count them.
  const int n = config_.worker_slots();
  auto out = std::make_shared<Buffer>(v->bytes);
  auto value_of = [&](uint32_t r) {
    auto it = v->replica_values.find(r);
    return it == v->replica_values.end() ? v->replica_base : it->second;
  };
  if (v->aggregation == Aggregation::kOnlyFirstReplica) {
    std::memcpy(out->data(), value_of(0)->data(), v->bytes);
    return out;
  }
  std::memset(out->data(), 0, v->bytes);
  const int64_t elems = NumElements(v->shape);
  for (int r = 0; r < n; ++r) AddInto(v->dtype, out->data(), value_of(static_cast<uint32_t>(r))->data(), elems);
  if (v->aggregation == Aggregation::kMean) Scale(v->dtype, out->data(), elems, 1.0 / n);
  return out;
}

namespace {

// `old` with `op` applied (a new buffer: the old one may still be read).
std::shared_ptr<Buffer> Updated(const Buffer& old, DType dtype, int64_t elems, UpdateOp op, const void* value,
                                double factor) {
  auto next = std::make_shared<Buffer>(old);
  switch (op) {
    case UpdateOp::kAssign:
      std::memcpy(next->data(), value, old.bytes());
      break;
    case UpdateOp::kAssignAdd:
      AddInto(dtype, next->data(), value, elems);
      break;
    case UpdateOp::kAssignSub: {
      Buffer neg(old.bytes());
      std::memcpy(neg.data(), value, old.bytes());
      Scale(dtype, neg.data(), elems, -1);
      AddInto(dtype, next->data(), neg.data(), elems);
      break;
    }
    case UpdateOp::kScale:
      Scale(dtype, next->data(), elems, factor);
      break;
  }
  return next;
}

}  // namespace

void TrainingEngine::ApplyUpdateLocked(Variable* v, UpdateOp op, const void* value, double factor) {
  v->published = Updated(*v->published, v->dtype, NumElements(v->shape), op, value, factor);
}

Status TrainingEngine::Reduce(bool mean, int64_t local_step, const std::vector<GradRef>& values_in, ReduceDone done,
                              int64_t replica) {
  std::vector<Variable*> targets;
  {
    MutexLock lock(&mu_);
    for (const GradRef& g : values_in) {
      Variable* v = FindLocked(g.name);
      if (v == nullptr) return NotFound("reduce_to: no variable named '" + std::string(g.name) + "'");
      if (v->trainable) {
        return InvalidArgument("reduce_to: destination '" + v->name +
                               "' is trainable (its optimizer owns it); reduce into a non-trainable variable");
      }
      if (v->sync_on_read) return InvalidArgument("reduce_to: destination '" + v->name + "' is sync-on-read");
      if (std::find(targets.begin(), targets.end(), v) != targets.end()) {
        return InvalidArgument("reduce_to: destination '" + v->name + "' appears twice in one call");
      }
      targets.push_back(v);
    }
  }
  ConvertedInputs converted;
  std::vector<GradRef> values = values_in;
  for (size_t i = 0; i < values.size(); ++i) {
    Status s = converted.Convert(&values[i], targets[i]->declared, targets[i]->dtype);
    if (!s.ok()) return Status(s.code(), "reduce_to '" + targets[i]->name + "': " + s.message());
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i].sparse()) return InvalidArgument("reduce_to takes dense values");
    Status s = DenseAccumulator::Check(targets[i]->dtype, targets[i]->shape, values[i].dtype, values[i].shape,
                                       values[i].bytes);
    if (!s.ok()) return Status(s.code(), "reduce_to '" + targets[i]->name + "': " + s.message());
  }
  // A round sums with one op: a value asking MEAN where the round's first asked SUM (or the other
  // way) is refused, not summed under the other's (checked again as it is added).
  for (Variable* v : targets) {
    MutexLock vlock(&v->mu);
    if (v->reduce_round.count > 0 && v->reduce_round.mean != mean) return MixedOps(v->name, v->reduce_round.mean);
  }
  // Completion of the whole call: the last entry's round to finish answers it.
  struct Call {
    Call(size_t n, ReduceDone d) : remaining(n), outcomes(n), done(std::move(d)) {}
    Mutex mu;
    size_t remaining GUARDED_BY(mu);
    std::vector<ReduceOutcome> outcomes GUARDED_BY(mu);
    const ReduceDone done;
  };
  auto call = std::make_shared<Call>(values.size(), std::move(done));
  auto finish_one = [call](size_t i, ReduceOutcome outcome) {
    MutexLock lock(&call->mu);
    call->outcomes[i] = std::move(outcome);
    if (--call->remaining > 0) return;
    auto outcomes = std::move(call->outcomes);
    lock.Unlock();
    call->done(std::move(outcomes));
  };
  for (size_t i = 0; i < values.size(); ++i) {
    Variable* v = targets[i];
    const GradRef& g = values[i];
    RoundDone completed;  // told outside the locks
    {
      MutexLock vlock(&v->mu);
      Round& r = v->reduce_round;
      const Contribution c = Classify(r, replica, local_step);
      // Stale, (a round begun since the check above) of the other op, or a replica's value while
      // its value of another step waits in this round: not summed.
      if (local_step < r.step || (r.count > 0 && r.mean != mean) || c == Contribution::kOther) {
        std::shared_ptr<Buffer> current;
        {
          MutexLock lock(&mu_);
          current = v->published;
        }
        int64_t stale_step = r.step;
        vlock.Unlock();  // `done` runs outside all locks
        finish_one(i, {false, stale_step, current, v->dtype, v->declared, v->shape});
        continue;
      }
      if (r.count == 0) {
        r.sum.assign((v->bytes + 7) / 8, 0);
        r.mean = mean;
      }
      DType dtype = v->dtype, declared = v->declared;
      Shape shape = v->shape;
      r.waiters.push_back(
          [finish_one, i, dtype, declared, shape](const Status&, int64_t step, std::shared_ptr<const Buffer> value) {
            finish_one(i, {true, step, std::move(value), dtype, declared, shape});
          });
      if (c == Contribution::kRetry) continue;  // its call's deadline passed: it waits for the round
      if (replica >= 0) r.senders.emplace_back(replica, local_step);
      AddInto(v->dtype, r.sum.data(), g.data, NumElements(v->shape));
      ++r.count;
      r.newest = std::max(r.newest, local_step);
      // (Read under the variable's lock: a count lowered before this add is seen here, one lowered
      // after it completes the round itself.)
      if (r.count < required_.load()) continue;
      completed = CompleteReduceRound(v);
    }
    completed.Tell();
  }
  return Status::Ok();
}

TrainingEngine::RoundDone TrainingEngine::CompleteReduceRound(Variable* v) {
  Round& r = v->reduce_round;
  auto out = std::make_shared<Buffer>(v->bytes);
  std::memcpy(out->data(), r.sum.data(), v->bytes);
  if (r.mean) Scale(v->dtype, out->data(), NumElements(v->shape), 1.0 / r.count);
  {
    MutexLock lock(&mu_);
    v->published = out;
  }
  RoundDone done;
  done.value = out;
  done.ready.swap(r.waiters);
  done.step = FinishRound(&r, config_.mode == Mode::kSync);
  return done;
}

TrainingEngine::RoundDone TrainingEngine::CompleteUpdateRound(Variable* v) {
  Round& r = v->update_round;
  RoundDone done;
  if (v->aggregation == Aggregation::kNone && r.disagree) {
    done.outcome = InvalidArgument("replicas assigned different values to '" + v->name +
                                   "' (aggregation NONE); nothing was changed");
  } else {
    const void* value = v->aggregation == Aggregation::kNone ? static_cast<const void*>(r.first.data())
                                                             : static_cast<const void*>(r.sum.data());
    if (v->aggregation == Aggregation::kMean) Scale(v->dtype, r.sum.data(), NumElements(v->shape), 1.0 / r.count);
    MutexLock lock(&mu_);
    ApplyUpdateLocked(v, r.op, value, 1);
  }
  done.ready.swap(r.waiters);
  done.step = FinishRound(&r, config_.mode == Mode::kSync);
  return done;
}

void TrainingEngine::CompleteLoweredRounds() {
  const int required = required_.load();
  for (Variable* v : Variables()) {
    if (v->trainable) continue;  // its rounds are the optimizer's (ReevaluateAll)
    RoundDone reduced, updated;
    {
      MutexLock vlock(&v->mu);
      if (v->reduce_round.count > 0 && v->reduce_round.count >= required) reduced = CompleteReduceRound(v);
      if (v->update_round.count > 0 && v->update_round.count >= required) updated = CompleteUpdateRound(v);
    }
    reduced.Tell();
    updated.Tell();
  }
}

void TrainingEngine::DropRoundWaiters() {
  for (Variable* v : Variables()) {
    std::vector<Round::Waiter> dropped;
    {
      MutexLock vlock(&v->mu);
      dropped.swap(v->reduce_round.waiters);
      for (auto& w : v->update_round.waiters) dropped.push_back(std::move(w));
      v->update_round.waiters.clear();
    }
    // (Destroyed here, outside the variable's lock: what they hold may take other locks.)
  }
}

Status TrainingEngine::Update(const UpdateArgs& args, UpdateDone done) {
  Variable* v = nullptr;
  {
    MutexLock lock(&mu_);
    v = FindLocked(args.name);
  }
  if (v == nullptr) return NotFound("update: no variable named '" + std::string(args.name) + "'");
  UpdateArgs a = args;
  ConvertedInputs converted;
  if (a.op != UpdateOp::kScale && a.dtype != v->dtype) {
    GradRef g{a.name, a.dtype, a.shape, a.data, a.bytes};
    Status s = converted.Convert(&g, v->declared, v->dtype);
    if (!s.ok()) return Status(s.code(), "update '" + v->name + "': " + s.message());
    a.dtype = g.dtype;
    a.data = g.data;
    a.bytes = g.bytes;
  }
  if (v->trainable) {
    return InvalidArgument("update: variable '" + v->name +
                           "' is trainable: its optimizer updates it from pushed gradients");
  }
  if (a.op == UpdateOp::kScale) {
    if (!std::isfinite(a.factor)) return InvalidArgument("update: scale factor must be finite");
  } else {
    PSD_RETURN_IF_ERROR(DenseAccumulator::Check(v->dtype, v->shape, a.dtype, a.shape, a.bytes));
  }
  // A sync-on-read variable keeps a value per replica: one a worker names beyond the job's (workers
  // are numbered below the larger of -N and -R) is refused, not added.
  const int n = config_.worker_slots();
  if (v->sync_on_read && !a.cross_replica && a.replica >= static_cast<uint32_t>(n)) {
    return InvalidArgument("update '" + v->name + "': replica " + std::to_string(a.replica) +
                           " is not one of the job's " + std::to_string(n) +
                           " replicas: a replica's own update comes from a worker of the job");
  }
  if (a.cross_replica && a.at_next_step && config_.mode == Mode::kSync && !v->sync_on_read) {
    int64_t lands = 0;
    {
      MutexLock lock(&mu_);
      const Buffer& base = v->staged_update ? *v->staged_update : *v->published;
      v->staged_update = Updated(base, v->dtype, NumElements(v->shape), a.op, a.data, a.factor);
      lands = global_step_.load() + 1;
    }
    done(Status::Ok(), true, lands);
    return Status::Ok();
  }
  if (a.cross_replica || v->sync_on_read) {
    {
      MutexLock lock(&mu_);
      if (!v->sync_on_read) {
        ApplyUpdateLocked(v, a.op, a.data, a.factor);
      } else if (!a.cross_replica) {
        // This replica's own value.
        auto& mine = v->replica_values[a.replica];
        mine = Updated(mine ? *mine : *v->replica_base, v->dtype, NumElements(v->shape), a.op, a.data, a.factor);
      } else {
        // Cross-replica on a sync-on-read variable: every replica gets the share that reads back
        // as the value (SUM: value / N each).
        Buffer share(v->bytes);
        if (a.op != UpdateOp::kScale) {
          std::memcpy(share.data(), a.data, v->bytes);
          if (v->aggregation == Aggregation::kSum) Scale(v->dtype, share.data(), NumElements(v->shape), 1.0 / n);
        }
        std::vector<std::shared_ptr<Buffer>*> all{&v->replica_base};
        for (auto& [r, b] : v->replica_values) all.push_back(&b);
        for (auto* b : all) *b = Updated(**b, v->dtype, NumElements(v->shape), a.op, share.data(), a.factor);
      }
    }
    done(Status::Ok(), true, 0);
    return Status::Ok();
  }
  if (v->aggregation == Aggregation::kOnlyFirstReplica) {
    bool first = a.replica == 0;
    if (first) {
      MutexLock lock(&mu_);
      ApplyUpdateLocked(v, a.op, a.data, a.factor);
    }
    done(Status::Ok(), first, 0);
    return Status::Ok();
  }
  if (a.op == UpdateOp::kScale) {
    return InvalidArgument("update: scale of '" + v->name +
                           "' in a replica context needs ONLY_FIRST_REPLICA "
                           "aggregation (or a cross-replica call)");
  }
  // SUM / MEAN / NONE: this replica's share of the round.
  RoundDone completed;  // told outside the locks
  {
    MutexLock vlock(&v->mu);
    Round& r = v->update_round;
    const Contribution c = Classify(r, a.sender, a.local_step);
    if (a.local_step < r.step || c == Contribution::kOther) {
      int64_t current = r.step;
      vlock.Unlock();
      done(Status::Ok(), false, current);  // stale (or its value of another step waits here): dropped
      return Status::Ok();
    }
    if (r.count > 0 && r.op != a.op) {
      return InvalidArgument("update: replicas use different operations on '" + v->name + "' in one round");
    }
    if (c == Contribution::kRetry) {  // its deadline passed: it waits for the round its share is in
      r.waiters.push_back(
          [done](const Status& s, int64_t step, std::shared_ptr<const Buffer>) { done(s, s.ok(), step); });
      return Status::Ok();
    }
    if (a.sender >= 0) r.senders.emplace_back(a.sender, a.local_step);
    if (r.count == 0) {
      r.sum.assign((v->bytes + 7) / 8, 0);
      r.first.assign((v->bytes + 7) / 8, 0);
      std::memcpy(r.first.data(), a.data, v->bytes);
      r.op = a.op;
      r.disagree = false;
    } else if (std::memcmp(r.first.data(), a.data, v->bytes) != 0) {
      r.disagree = true;
    }
    AddInto(v->dtype, r.sum.data(), a.data, NumElements(v->shape));
    ++r.count;
    r.newest = std::max(r.newest, a.local_step);
    r.waiters.push_back(
        [done](const Status& s, int64_t step, std::shared_ptr<const Buffer>) { done(s, s.ok(), step); });
    if (r.count < required_.load()) return Status::Ok();
    completed = CompleteUpdateRound(v);
  }
  completed.Tell();
  return Status::Ok();
}

}  // namespace psd::server
