// TrainingEngine: consistent snapshots at step boundaries, restore, and the placements it holds.
#include "core/training_engine.h"
#include "core/training_engine_internal.h"

namespace psd::server {

using namespace engine_internal;

std::vector<VarPlacement> TrainingEngine::Placements(int shard) const {
  MutexLock lock(&mu_);
  std::vector<VarPlacement> out;
  for (auto& [name, v] : vars_) {
    if (!v->placement.name.empty()) {
      out.push_back(v->placement);
    } else {
      out.push_back({v->name, v->declared, v->shape, false, {{shard, 0, v->shape.empty() ? 1 : v->shape[0]}}, true});
    }
    out.back().trainable = v->trainable;
  }
  return out;
}

ShardSnapshot TrainingEngine::SnapshotLocked() {
  // Two passes: first all that a snapshot allocates (the slots' copies, a sync-on-read variable's
  // combined value, the lists), then what it changes (the kept copies, the slots' lists of
  // changes), which allocates nothing. Out of memory, it throws having changed nothing: a commit
  // goes on without it (CommitLocked).
  ShardSnapshot snap;
  snap.step = global_step_.load();
  snap.epoch = epoch_;
  snap.learning_rate = next_lr_.load();
  snap.optimizer = optimizer_->name();
  struct SlotCopy {
    Variable* v;
    size_t slot;
    std::shared_ptr<Buffer> copy;  // null: the oldest kept copy is brought up to date instead
  };
  std::vector<SlotCopy> copies;
  snap.variables.reserve(vars_.size());
  for (auto& [name, v] : vars_) {
    VariableSnapshot vs;
    vs.name = v->name;
    vs.dtype = v->declared;  // the buffers are of ComputeDType(declared)
    vs.shape = v->shape;
    vs.trainable = v->trainable;
    vs.average = v->average;
    vs.optimizer = v->optimizer_name;
    vs.value = ReadValueLocked(v.get());
    vs.shadow = v->shadow;
    vs.aggregation = static_cast<int>(v->aggregation);
    vs.sync_on_read = v->sync_on_read;
    vs.placement = v->placement;
    auto names = v->opt->SlotNames();
    if (keep_committed_) {
      v->slot_copies.resize(v->slots.size());
      for (auto& made : v->slot_copies) made.reserve(3);
    }
    for (size_t k = 0; k < v->slots.size(); ++k) {
      // Copied (slots are updated in place); the copy lists what a sparse step wrote since the
      // previous snapshot's copy, and the slot lists from this one on. With replicas the copy is
      // made in the copy of three snapshots ago once the kept copies let it go, brought up to date
      // from the lists of the two copies since and the slot's (Buffer::CatchUp), not copied whole.
      const Buffer& slot = v->slots[k];
      bool reuse = false;
      if (keep_committed_) {
        const auto& made = v->slot_copies[k];
        reuse = made.size() == 3 && made.front().use_count() == 1 && made.front()->bytes() == slot.bytes();
      }
      copies.push_back({v.get(), k, reuse ? nullptr : std::make_shared<Buffer>(slot)});
      vs.slots.emplace_back(names[k], nullptr);
    }
    snap.variables.push_back(std::move(vs));
  }
  // Nothing below allocates.
  auto next = copies.begin();
  for (VariableSnapshot& vs : snap.variables) {
    for (auto& [slot_name, out] : vs.slots) {
      Variable* v = next->v;
      Buffer& slot = v->slots[next->slot];
      std::shared_ptr<Buffer> copy = std::move(next->copy);
      if (keep_committed_) {
        std::vector<std::shared_ptr<Buffer>>& made = v->slot_copies[next->slot];
        if (made.size() == 3) {
          if (!copy) {
            copy = std::move(made.front());
            copy->CatchUp(slot, {made[2].get(), made[1].get()});
          }
          made.erase(made.begin());
        }
      }
      copy->TakeChangesOf(slot);
      slot.MarkCopiedFrom(*copy);
      if (keep_committed_) v->slot_copies[next->slot].push_back(copy);  // within the room reserved
      out = std::move(copy);
      ++next;
    }
  }
  return snap;
}

std::optional<ShardSnapshot> TrainingEngine::SnapshotIfAtBoundary() {
  if (config_.mode != Mode::kSync) {
    // Each variable's slots are updated under its own mutex: hold all of them (in name order,
    // the map's order, so two snapshots cannot deadlock) to copy every slot with its value.
    std::vector<std::unique_lock<Mutex>> locks;
    for (Variable* v : Variables()) locks.emplace_back(v->mu);
    MutexLock lock(&mu_);
    return SnapshotLocked();
  }
  MutexLock lock(&mu_);
  if (step_takes_begun_ > 0) return std::nullopt;
  return SnapshotLocked();
}

std::optional<ShardSnapshot> TrainingEngine::TakeCommitted() {
  MutexLock lock(&mu_);
  std::optional<ShardSnapshot> out = std::move(committed_);
  committed_.reset();
  return out;
}

void TrainingEngine::RequestSnapshot() {
  std::optional<ShardSnapshot> snap;
  if (config_.mode == Mode::kSync) {
    // Not while a commit's averages are being updated either: then it is taken when they are.
    MutexLock lock(&mu_);
    if (step_takes_begun_ > 0 || averages_pending_ > 0) {
      snapshot_requested_ = true;  // taken inside the next commit, or once the averages are in
      return;
    }
    snap = SnapshotLocked();
  } else {
    snap = SnapshotIfAtBoundary();
  }
  if (on_snapshot_) on_snapshot_(std::move(*snap));
}

void TrainingEngine::RaiseGlobalStep(int64_t step) {
  if (config_.mode == Mode::kSync) return;
  int64_t now = global_step_.load();
  while (now < step && !global_step_.compare_exchange_weak(now, step)) {
  }
}

Status TrainingEngine::Restore(const ShardSnapshot& snap) {
  {
    MutexLock lock(&mu_);
    if (!vars_.empty()) return FailedPrecondition("restore needs an empty daemon");
  }
  if (snap.optimizer != optimizer_->name()) {
    return FailedPrecondition("the checkpoint was written with --optimizer " + snap.optimizer + ", psd runs " +
                              optimizer_->name());
  }
  for (const VariableSnapshot& vs : snap.variables) {
    VariableDef def;
    def.name = vs.name;
    def.dtype = vs.dtype;
    def.shape = vs.shape;
    def.adopt = vs.value;  // no copy: shared copy-on-write with the snapshot
    def.trainable = vs.trainable;
    def.average = vs.average && config_.ema_decay > 0;
    def.optimizer = vs.optimizer;
    def.placement = vs.placement;
    auto aggregation = AggregationFromNumber(vs.aggregation);
    if (!aggregation.ok()) return aggregation.status();
    def.aggregation = *aggregation;
    def.sync_on_read = vs.sync_on_read;
    auto created = CreateVariable(def);
    if (!created.ok()) return created.status();
  }
  for (const VariableSnapshot& vs : snap.variables) {
    Variable* v = nullptr;
    {
      MutexLock lock(&mu_);
      v = FindLocked(vs.name);
    }
    if (test_hook_) test_hook_("restore.variable");
    // The documented order: the variable's lock, then the engine's.
    MutexLock vlock(&v->mu);
    MutexLock lock(&mu_);
    v->next_take_step = snap.step;
    auto names = v->opt->SlotNames();
    for (auto& [slot, buf] : vs.slots) {
      auto it = std::find(names.begin(), names.end(), slot);
      if (it == names.end())
        return FailedPrecondition("checkpoint slot '" + slot + "' of '" + vs.name + "' is unknown");
      std::memcpy(v->slots[it - names.begin()].data(), buf->data(), std::min(buf->bytes(), v->bytes));
    }
    if (v->shadow && vs.shadow) v->shadow = std::make_shared<Buffer>(*vs.shadow);
    v->reduce_round.step = v->update_round.step = snap.step;
    if (v->sync_on_read && v->aggregation == Aggregation::kSum) {
      // The seed's rule: a SUM sync-on-read variable is restored by dividing by the replicas.
      Scale(v->dtype, v->replica_base->data(), NumElements(v->shape),
            1.0 / static_cast<double>(config_.worker_slots()));
    }
  }
  MutexLock lock(&mu_);
  global_step_.store(snap.step);
  next_lr_.store(snap.learning_rate);
  step_lr_ = snap.learning_rate;
  return Status::Ok();
}

}  // namespace psd::server
