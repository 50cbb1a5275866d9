// TrainingEngine: takes, optimizer applies, the sync commit and its cluster gate, async/ssp
// applies, soft-sync forcing and moving averages.
#include <algorithm>
#include <array>
#include <cstring>
#include <new>
#include <optional>

#include "base/scope_exit.h"
#include "core/training_engine.h"
#include "core/training_engine_internal.h"
#include "psd/cores.h"

namespace psd::server {

using namespace engine_internal;

namespace {

// `args` narrowed to elements [b, e), with `grad` holding element b's gradient first.
ApplyArgs Slice(const ApplyArgs& args, int64_t b, int64_t e, const void* grad) {
  const size_t es = DTypeSize(args.dtype);
  ApplyArgs part = args;
  part.num_elements = e - b;
  part.value = static_cast<const uint8_t*>(args.value) + static_cast<size_t>(b) * es;
  part.grad = grad;
  part.out = static_cast<uint8_t*>(args.out) + static_cast<size_t>(b) * es;
  part.slot_offset = args.slot_offset + b;
  return part;
}

}  // namespace

void TrainingEngine::ApplyDense(const Optimizer& opt, const ApplyArgs& args) {
  auto t0 = std::chrono::steady_clock::now();
  if (args.num_elements <= kParallelApplyElements) {
    opt.Apply(args);
    ReportApply(t0);
    return;
  }
  // Ranges touch disjoint elements of value/out/slots, so they can run in parallel.
  const size_t es = DTypeSize(args.dtype);
  pool_.ParallelFor(args.num_elements, kParallelApplyElements / 4, [&](int64_t b, int64_t e) {
    opt.Apply(Slice(args, b, e, static_cast<const uint8_t*>(args.grad) + static_cast<size_t>(b) * es));
  });
  ReportApply(t0);
}

void TrainingEngine::ApplyTaken(const Optimizer& opt, const ApplyArgs& args, const DenseAccumulator& acc) {
  if (!acc.unsent().empty()) {
    // A forced take where some parts got no gradient: those keep their value and slots; the
    // runs between them are applied as usual (their sum is resolved: no held parts).
    const size_t es = DTypeSize(args.dtype);
    int64_t at = 0;
    auto apply = [&](int64_t b, int64_t e) {
      if (e > b)
        ApplyDense(opt, Slice(args, b, e, static_cast<const uint8_t*>(args.grad) + static_cast<size_t>(b) * es));
    };
    for (const auto& [begin, end] : acc.unsent()) {
      apply(at, begin);
      std::memcpy(static_cast<uint8_t*>(args.out) + static_cast<size_t>(begin) * es,
                  static_cast<const uint8_t*>(args.value) + static_cast<size_t>(begin) * es,
                  static_cast<size_t>(end - begin) * es);
      at = end;
    }
    return apply(at, args.num_elements);
  }
  if (!acc.taken_holds()) return ApplyDense(opt, args);
  auto t0 = std::chrono::steady_clock::now();
  // In blocks aligned to the accumulator's parts, each block's gradient read where it lies or, for
  // parts that still point at held gradients, formed in a block-sized scratch that stays in cache.
  const int64_t blocks = (args.num_elements + kApplyBlockElements - 1) / kApplyBlockElements;
  auto run = [&](int64_t b0, int64_t b1) {
    // Room for a block of float64 elements (32 KiB, on the stack: a chunk on an apply thread
    // allocates nothing, so it cannot fail half-way through a take).
    std::array<double, kApplyBlockElements> scratch;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t end = std::min(args.num_elements, (b + 1) * kApplyBlockElements);
      for (int64_t at = b * kApplyBlockElements; at < end;) {
        int64_t run_end = end;
        const void* grad = acc.TakenGrad(args.grad, at, end, scratch.data(), &run_end);
        opt.Apply(Slice(args, at, run_end, grad));
        at = run_end;
      }
    }
  };
  if (args.num_elements <= kParallelApplyElements) {
    run(0, blocks);
  } else {
    pool_.ParallelFor(blocks, kParallelApplyElements / 4 / kApplyBlockElements, run);
  }
  ReportApply(t0);
}

std::unique_ptr<DenseAccumulator> TrainingEngine::NewDenseAccumulator(const Variable& v, int64_t step) const {
  auto acc = std::make_unique<DenseAccumulator>(v.dtype, v.shape, config_.reduction, step, config_.deterministic);
  if (config_.deterministic) {
    acc->LimitSlots(2 * config_.worker_slots() + 8);
  }
  return acc;
}

std::unique_ptr<SparseAccumulator> TrainingEngine::NewSparseAccumulator(const Variable& v, int64_t step) const {
  auto acc = std::make_unique<SparseAccumulator>(v.dtype, v.shape, config_.reduction, step);
  // Concurrent adds: one per I/O thread, at most one per worker.
  const int adds = config_.concurrent_adds > 0 ? config_.concurrent_adds : psd::ThreadsOrCores(0);
  acc->SetAdders(config_.total_replicas > 0 ? std::min(adds, config_.total_replicas) : adds);
  return acc;
}

void TrainingEngine::OfferSpareLocked(Variable* v) {
  if (v->dense->has_sum() && !v->spare_offered) return;
  // The sum goes into the buffer the last commit retired (the value before it), unless a pull still
  // reads that one: then it is offered again at the round's next gradient and at its take (held
  // gradients need no sum until then), until the round takes a new buffer of its own.
  MutexLock elock(&mu_);
  if (!v->dense->has_sum() && v->spare && v->spare.use_count() == 1) v->dense->ProvideSum(std::move(v->spare));
  if (v->dense->has_sum()) v->spare.reset();
  v->spare_offered = v->spare != nullptr;
  v->older.reset();
}

void TrainingEngine::ReportApply(std::chrono::steady_clock::time_point t0) {
  if (on_apply_) on_apply_(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

void TrainingEngine::AwaitAddsLocked(Variable* v) {
  while (AddsInFlightLocked(v) > 0) v->adds_done.Wait(&v->mu);
}

int TrainingEngine::AddsInFlightLocked(Variable* v) {
  return (v->dense ? v->dense->in_flight() : 0) + (v->sparse ? v->sparse->in_flight() : 0);
}

std::vector<TrainingEngine::Variable*> TrainingEngine::Variables(bool trainable_only) {
  std::vector<Variable*> all;
  MutexLock lock(&mu_);
  for (auto& [name, v] : vars_) {
    if (!trainable_only || v->trainable) all.push_back(v.get());
  }
  return all;
}

bool TrainingEngine::ResolveHeld() {
  bool copied = true;
  for (Variable* v : Variables()) {
    MutexLock lock(&v->mu);
    if (!v->dense || !v->dense->holds()) continue;
    AwaitAddsLocked(v);
    OfferSpareLocked(v);  // the copy goes into the sum: the buffer the last commit retired, if free
    try {
      v->dense->ResolveHeld();
    } catch (const std::bad_alloc&) {
      copied = false;  // no buffer for the sum: still held (the copy allocates before it changes anything)
    }
  }
  return copied;
}

std::string TrainingEngine::WaitingVariables(size_t max_named) {
  const int64_t step = global_step_.load();
  const int required = required_.load();
  std::string named;
  size_t waiting = 0;
  for (Variable* v : Variables(/*trainable_only=*/true)) {
    MutexLock lock(&v->mu);
    if (v->next_take_step != step) continue;  // taken for this step
    const int have = v->dense ? v->dense->num_accumulated() : v->sparse ? v->sparse->num_accumulated() : 0;
    if (have >= required) continue;
    if (++waiting > max_named) continue;
    if (!named.empty()) named += ", ";
    named += "'" + v->name + "' (" + std::to_string(have) + " of " + std::to_string(required) + ")";
  }
  if (waiting > max_named) named += " and " + std::to_string(waiting - max_named) + " more";
  return named;
}

bool TrainingEngine::MaybeTakeLocked(Variable* v, bool force, int* count) {
  const int64_t step = global_step_.load();
  if (v->next_take_step != step) return false;  // already taken this step
  // Gradients still being added belong to this step: the last of them to end takes (or a forced
  // take waits for them).
  if (AddsInFlightLocked(v) > 0) {
    if (!force) return false;
    AwaitAddsLocked(v);
    // The add that ended may have taken it and committed the step meanwhile: the next step's take
    // is not this one to force (its gradients would be refused as stale).
    if (v->next_take_step != step || global_step_.load() != step) return false;
  }
  // A dense take's one allocation (the sum's buffer, when no add wrote one and no spare was free)
  // comes before it changes anything: out of memory, it is tried again later (DeferTakeLocked).
  if (force) {
    *count = 0;
    if (v->dense) {
      try {
        v->dense->ForceTake(count);
      } catch (const std::bad_alloc&) {
        return DeferTakeLocked(v, true);
      }
    }
    if (v->sparse) v->sparse->ForceTake(count);
  } else {
    Result<bool> taken = false;
    if (v->dense) {
      if (v->dense->num_accumulated() >= required_.load()) OfferSpareLocked(v);  // a take may need the sum's buffer
      try {
        taken = v->dense->TryTakeGrad(required_.load(), count, /*keep_held=*/true);
      } catch (const std::bad_alloc&) {
        return DeferTakeLocked(v, false);
      }
    }
    if (v->sparse) taken = v->sparse->TryTakeGrad(required_.load(), count);
    if (!taken.ok() || !*taken) return false;
  }
  ++v->next_take_step;
  if (*count == 0) return true;  // forced with nothing: the value stays
  if (v->kind == GradKind::kSparse) {
    MutexLock lock(&mu_);
    // The last take's rows were applied at its commit (cleared, not freed): their buffers hold the
    // next step's rows, so a step allocates nothing once both have grown.
    v->sparse->ReleaseTaken(&v->pending_sparse);
    v->pending_granule_rows = v->sparse->taken_granule_rows();
    v->sparse_pending = true;
    ++step_takes_begun_;
    return true;
  }
  // The optimizer writes the new values over the taken sum (each element's gradient is read before
  // its value is written), and that buffer is what the commit publishes: a variable holds its
  // value and one sum, not a third staging buffer.
  std::shared_ptr<const Buffer> value;  // read only: its change list (replication) and generation stay
  std::shared_ptr<Buffer> out = v->dense->ReleaseSum();
  double lr;
  {
    MutexLock lock(&mu_);
    value = v->published;
    lr = step_lr_;
    ++step_takes_begun_;  // from here on this variable's slots belong to the open step
  }
  ApplyTaken(*v->opt,
             {v->dtype, NumElements(v->shape), value->data(), out->data(), out->data(), &v->slots, 0, v->next_take_step,
              lr, v->dense->divisor()},
             *v->dense);
  v->dense->DropTakenHolds();
  MutexLock lock(&mu_);
  v->staged = std::move(out);
  return true;
}

void TrainingEngine::CopyOnWriteLocked(Variable* v) {
  if (v->published.use_count() <= 1) return;
  // Into a retired value that nothing holds any more, brought up to date by copying only what the
  // steps since listed (Buffer::CatchUp; all of it when they did not), so a big table is neither
  // copied whole nor mapped afresh every step: the spare (the value before the published one, once
  // a pull that read it is done) or, with replicas, whose copies still hold the spare, the one
  // before it (`older`, let go by the copy of two steps ago). The published value becomes the spare.
  // Read through const: the published buffer is shared with a kept copy, and a writable data()
  // would end the list of changes that copy's difference is compared by.
  const Buffer& from = *v->published;
  auto free_of_size = [&from](const std::shared_ptr<Buffer>& b) {
    return b && b.use_count() == 1 && b->bytes() == from.bytes();
  };
  std::shared_ptr<Buffer> into;
  if (free_of_size(v->spare)) {
    into = std::move(v->spare);
    into->CatchUp(from, {});
    v->older.reset();  // before the spare: no use any more
  } else if (free_of_size(v->older)) {
    into = std::move(v->older);
    into->CatchUp(from, {v->spare.get()});
    v->older = std::move(v->spare);
  } else {
    into = std::make_shared<Buffer>(from);
    into->MarkCopiedFrom(from);  // what the step writes next is listed (replication's difference)
    v->older = std::move(v->spare);
  }
  v->spare = std::move(v->published);
  v->published = std::move(into);
}

SparseApplyArgs TrainingEngine::ListSparseRowsLocked(Variable* v, const int64_t* rows, size_t n, const void* grad,
                                                     const uint32_t* order, int64_t step, double lr) {
  // Listed in increasing order: neighbouring rows make one range, so the list stays short.
  const uint64_t row_bytes = static_cast<uint64_t>(v->row_elements) * DTypeSize(v->dtype);
  for (size_t i = 0; i < n; ++i) {
    const int64_t r = rows[order != nullptr ? order[i] : i];
    v->published->MarkChanged(static_cast<uint64_t>(r) * row_bytes, row_bytes);
  }
  SparseApplyArgs args{
      v->dtype, v->row_elements, v->published->listed_data(), rows, static_cast<int64_t>(n), grad, &v->slots, step, lr,
      order};
  v->opt->ListSparseSlots(args);
  args.slots_listed = true;
  return args;
}

void TrainingEngine::ApplyPendingSparseLocked(Variable* v, int64_t step, double lr) {
  size_t rows = 0;
  for (const SparseRows& part : v->pending_sparse) rows += part.indices.size();
  if (rows > 0) {
    auto t0 = std::chrono::steady_clock::now();
    // Updated stripe by stripe when their granules are coarse (a stripe's rows lie in a few big
    // runs of the table); in contiguous index ranges when they are fine (a stripe's rows are spread
    // over the whole table, a range's share its pages and the page tables' lines): then the rows in
    // index order, and where each one's sum is, are listed first.
    const bool by_ranges = v->pending_granule_rows < SparseAccumulator::kCoarseGranuleRows;
    // Its allocations were made before the commit changed anything (PrepareCommitLocked): none now.
    PrepareSparseApplyLocked(v);
    // The rows written, in increasing order across the stripes (their rows interleave granule by
    // granule): neighbouring rows make one range of the value's and each slot's list of changes.
    const uint64_t row_bytes = static_cast<uint64_t>(v->row_elements) * DTypeSize(v->dtype);
    Buffer* const value = v->published.get();
    std::vector<Buffer>* const slots = &v->slots;
    const std::vector<SparseRows>& parts = v->pending_sparse;
    int64_t* const listed = v->apply_rows.data();
    const void** const grads = v->apply_grads.data();
    size_t n = 0;
    SparseAccumulator::ForEachRowInOrder(
        parts,
        [&](int64_t r, int64_t stripe, uint32_t position) {
          value->MarkChanged(static_cast<uint64_t>(r) * row_bytes, row_bytes);
          for (Buffer& slot : *slots) slot.MarkChanged(static_cast<uint64_t>(r) * row_bytes, row_bytes);
          if (!by_ranges) return;
          listed[n] = r;
          grads[n++] = parts[static_cast<size_t>(stripe)].values.data() + position * row_bytes;
        },
        v->pending_granule_rows);
    const Optimizer& opt = *v->opt;
    SparseApplyArgs all{v->dtype, v->row_elements, v->published->listed_data(), nullptr, 0, nullptr, &v->slots, step,
                        lr};
    all.slots_listed = true;
    if (by_ranges) {
      all.rows = listed;
      all.grad_rows = grads;
      pool_.ParallelFor(static_cast<int64_t>(rows), kSparseApplyGrainRows, [&opt, &all](int64_t begin, int64_t end) {
        SparseApplyArgs range = all;
        range.rows += begin;
        range.grad_rows += begin;
        range.num_rows = end - begin;
        opt.UpdateSparse(range);
      });
    } else {
      std::array<SparseApplyArgs, SparseAccumulator::kMaxStripes> stripes;
      size_t count = 0;
      for (const SparseRows& part : parts) {
        if (part.indices.empty()) continue;
        SparseApplyArgs& a = stripes[count++];
        a = all;
        a.rows = part.indices.data();
        a.num_rows = static_cast<int64_t>(part.indices.size());
        a.grad = part.values.data();
        a.order = part.order.data();
      }
      pool_.ParallelFor(static_cast<int64_t>(count), 1, [&opt, &stripes](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) opt.UpdateSparse(stripes[static_cast<size_t>(i)]);
      });
    }
    ReportApply(t0);
  }
  // Cleared, not freed: they hold a later step's rows (SparseAccumulator::ReleaseTaken).
  for (SparseRows& part : v->pending_sparse) {
    part.indices.clear();
    part.values.clear();
    part.order.clear();
  }
  v->apply_rows.clear();
  v->apply_grads.clear();
}

void TrainingEngine::PrepareSparseApplyLocked(Variable* v) {
  size_t rows = 0;
  for (const SparseRows& part : v->pending_sparse) rows += part.indices.size();
  if (rows == 0) return;
  if (v->pending_granule_rows < SparseAccumulator::kCoarseGranuleRows) {  // the list of rows in index order
    v->apply_rows.resize(rows);
    v->apply_grads.resize(rows);
  }
  // In place unless a pull or a kept copy still references the published buffer: then copy first.
  CopyOnWriteLocked(v);
}

bool TrainingEngine::PrepareCommitLocked() {
  for (auto& [name, var] : vars_) {
    Variable* v = var.get();
    if (!v->trainable || !v->sparse_pending) continue;
    try {
      PrepareSparseApplyLocked(v);
    } catch (const std::bad_alloc&) {
      const int64_t step = global_step_.load();
      if (commit_deferred_logged_ != step) {
        commit_deferred_logged_ = step;
        spdlog::warn(
            "step {}: out of memory for the update of sparse variable '{}' ({} bytes: a copy of its value, as a "
            "pull or a kept copy still reads it, or the list of the step's rows); the step is not committed until "
            "memory allows (is --max-model-bytes above the memory this host has?)",
            step, v->name, v->bytes);
      }
      return false;
    }
  }
  return true;
}

void TrainingEngine::DeferCommitLocked(MutexLock& lock, bool forced) {
  commit_deferred_ = forced ? 2 : 1;
  lock.UnlockFor(&mu_);
  ArmRetry(1);
}

std::optional<ShardSnapshot> TrainingEngine::TrySnapshotLocked(int64_t step, bool checkpoint) {
  try {
    std::optional<ShardSnapshot> snap = SnapshotLocked();
    snapshot_requested_ = false;
    return snap;
  } catch (const std::bad_alloc&) {
    // The step is committed all the same (its tokens go out): a checkpoint is taken at the next
    // commit instead, a replica's copy from the engine when it is asked for one.
    if (checkpoint) snapshot_requested_ = true;
    spdlog::warn("step {}: out of memory for the snapshot of the step (its optimizer slots are copied{}); {}", step,
                 checkpoint ? " for a checkpoint" : " for the replicas",
                 checkpoint ? "the checkpoint is taken at a later step" : "the replicas ask for it again");
    return std::nullopt;
  }
}

template <typename Prepare, typename Write>
void TrainingEngine::WriteInPlace(Variable* v, Prepare prepare, Write write) {
  std::optional<decltype(prepare())> how;
  {
    MutexLock lock(&mu_);
    // In place unless a pull or a kept copy still references the published buffer: then copy first.
    CopyOnWriteLocked(v);
    how.emplace(prepare());
    v->writing_in_place = true;
  }
  ScopeExit done([this, v] {
    MutexLock lock(&mu_);
    v->writing_in_place = false;
    in_place_done_.NotifyAll();
  });
  write(*how);
}

void TrainingEngine::AwaitInPlaceWriteLocked(Variable* v) {
  while (v->writing_in_place) in_place_done_.Wait(&mu_);
}

void TrainingEngine::ApplyNowLocked(Variable* v, const GradRef& g, int64_t step, double lr) {
  if (g.chunk()) return ApplyChunkLocked(v, g, step, lr);
  if (g.sparse()) {
    if (g.nnz == 0) return;
    auto t0 = std::chrono::steady_clock::now();
    WriteInPlace(
        v,
        [&]() REQUIRES(mu_) {
          return ListSparseRowsLocked(v, g.indices, static_cast<size_t>(g.nnz), g.data, /*order=*/nullptr, step,
                                      lr);  // a gradient's rows increase
        },
        [&](const SparseApplyArgs& args) {
          if (test_hook_) test_hook_("apply.in_place");
          v->opt->UpdateSparse(args);
        });
    ReportApply(t0);
    return;
  }
  std::shared_ptr<const Buffer> value;  // read only (as in the take)
  std::shared_ptr<Buffer> out;
  {
    MutexLock lock(&mu_);
    value = v->published;
    if (v->spare && v->spare.use_count() == 1) out = std::move(v->spare);
    v->spare.reset();
    v->older.reset();
  }
  if (!out) out = std::make_shared<Buffer>(v->bytes);
  ApplyDense(*v->opt, {v->dtype, NumElements(v->shape), value->data(), g.data, out->data(), &v->slots, 0, step, lr});
  MutexLock lock(&mu_);
  v->spare = std::move(v->published);
  v->published = std::move(out);
}

void TrainingEngine::ApplyChunkLocked(Variable* v, const GradRef& g, int64_t step, double lr) {
  const size_t es = DTypeSize(v->dtype);
  WriteInPlace(
      v,
      [&]() REQUIRES(mu_) {
        v->published->MarkChanged(static_cast<uint64_t>(g.chunk_offset) * es, static_cast<uint64_t>(g.shape[0]) * es);
        return static_cast<uint8_t*>(v->published->listed_data()) + static_cast<size_t>(g.chunk_offset) * es;
      },
      [&](uint8_t* at) {
        if (test_hook_) test_hook_("apply.in_place");
        ApplyDense(*v->opt, {v->dtype, g.shape[0], at, g.data, at, &v->slots, g.chunk_offset, step, lr});
      });
}

void TrainingEngine::OnTaken(int count) {
  MutexLock lock(&mu_);
  step_min_count_ = std::min(step_min_count_, count);
  step_max_count_ = std::max(step_max_count_, count);
  ++step_takes_;
  if (--pending_takes_ > 0) return;
  StepReadyLocked(lock, false);
}

void TrainingEngine::StepReadyLocked(MutexLock& lock, bool forced) {
  if (commit_->commits_locally()) {
    if (!PrepareCommitLocked()) return DeferCommitLocked(lock, forced);
    return CommitLocked(lock, forced);
  }
  if (prepared_) return lock.UnlockFor(&mu_);
  prepared_ = true;
  step_forced_ = forced;
  int64_t step = global_step_.load();
  int min = step_min_count_ == INT_MAX ? 0 : step_min_count_, max = step_max_count_, takes = step_takes_;
  lock.UnlockFor(&mu_);
  commit_->OnPrepared({step, min, max, takes, forced});
}

void TrainingEngine::ReportIfIdle() {
  MutexLock lock(&mu_);
  if (commit_->commits_locally() || prepared_ || pending_takes_ != 0 || config_.mode != Mode::kSync) return;
  StepReadyLocked(lock, false);
}

Status TrainingEngine::CommitPrepared(int64_t step, bool snapshot, double next_lr) {
  // Every variable lock is held while untaken variables are looked for, so no take runs half-way
  // through: a variable created after this shard reported an idle step (the chief may commit
  // before it hears the report withdrawn) skips the step — its accumulated gradients are dropped.
  std::vector<Variable*> all = Variables();
  std::vector<std::unique_lock<Mutex>> vlocks;
  for (Variable* v : all) {
    vlocks.emplace_back(v->mu);
    v->mu.AssertHeld();  // in vlocks
    AwaitAddsLocked(v);  // its accumulator may be replaced below
  }
  MutexLock lock(&mu_);
  if (global_step_.load() != step) {
    return FailedPrecondition("asked to commit step " + std::to_string(step) + " at step " +
                              std::to_string(global_step_.load()));
  }
  if (!PrepareCommitLocked()) {
    return ResourceExhausted("out of memory for step " + std::to_string(step) +
                             "'s update on this shard (its log names the variable); nothing of the step was "
                             "applied here");
  }
  for (Variable* v : all) {
    v->mu.AssertHeld();  // in vlocks
    if (!v->trainable || v->next_take_step != step) continue;
    spdlog::warn("variable '{}' was created while step {} was closing; it joins step {}", v->name, step, step + 1);
    v->next_take_step = step + 1;
    if (v->dense) v->dense = NewDenseAccumulator(*v, step + 1);
    if (v->sparse) {
      v->sparse = NewSparseAccumulator(*v, step + 1);
      SettleStagingLocked(v);  // rows kept for gradients sent in parts went with the old one
    }
    --pending_takes_;
  }
  vlocks.clear();
  prepared_ = false;
  if (snapshot) snapshot_requested_ = true;
  if (next_lr > 0) next_lr_.store(next_lr);
  CommitLocked(lock, step_forced_);
  return Status::Ok();
}

void TrainingEngine::CommitLocked(MutexLock& lock, bool forced) {
  commit_deferred_ = 0;  // (committed now, whichever call it is)
  int64_t step = global_step_.load() + 1;
  int trainable = 0;
  for (auto& [name, var] : vars_) {
    Variable* v = var.get();
    if (!v->trainable) continue;
    ++trainable;
    if (v->staged) {
      v->spare = std::move(v->published);
      v->published = std::move(v->staged);
      v->older.reset();
    }
    if (v->sparse_pending) {
      ApplyPendingSparseLocked(v, step, step_lr_);
      v->sparse_pending = false;
    }
  }
  for (auto& [name, var] : vars_) {
    if (var->staged_update) var->published = std::move(var->staged_update);  // at_next_step updates
  }
  pending_takes_ = trainable;
  global_step_.store(step);
  step_takes_begun_ = 0;
  step_takes_ = 0;
  step_forced_ = false;
  std::optional<ShardSnapshot> snapshot;
  const bool checkpoint =
      snapshot_requested_ || (config_.checkpoint_every_steps > 0 && step % config_.checkpoint_every_steps == 0);
  if (checkpoint || keep_committed_) {
    snapshot = TrySnapshotLocked(step, checkpoint);  // no take for the next step can touch slots while mu_ is held
  }
  StepInfo info{step, step_min_count_ == INT_MAX ? 0 : step_min_count_, step_max_count_, forced};
  last_step_gradients_ = info.min_gradients;
  step_min_count_ = INT_MAX;  // none taken yet (a forced take of 0 gradients is a real 0)
  step_max_count_ = 0;
  step_started_ = false;
  step_lr_ = next_lr_.load();
  std::optional<AveragesTurn> turn;
  if (config_.ema_decay > 0) {
    turn = TakeAveragesTurnLocked(step);
    ++averages_pending_;
  }
  lock.UnlockFor(&mu_);
  // Until UpdateAverages has its turn, a throw (a bad_alloc in the token push) would leave the turn
  // unserved and every later commit waiting for it: it is served then, and the count given back.
  ScopeExit unserved([this, &turn] {
    if (!turn) return;
    UpdateAverages(AveragesTurn{turn->ticket, turn->step, {}});
    MutexLock relock(&mu_);
    --averages_pending_;
  });
  if (commit_->commits_locally()) tokens_.Push(step, config_.tokens_per_step);  // cluster: the chief's coordinator does
  std::vector<std::pair<Variable*, std::shared_ptr<Buffer>>> shadows;
  unserved.Dismiss();
  if (turn) shadows = UpdateAverages(std::move(*turn));
  std::optional<ShardSnapshot> asked;  // requested while the averages were updated (RequestSnapshot waited)
  if (snapshot || turn) {
    MutexLock relock(&mu_);
    if (turn) --averages_pending_;
    if (snapshot) {
      // Averages are updated after the tokens (TF's order); the snapshot takes this step's.
      for (auto& vs : snapshot->variables) {
        Variable* v = FindLocked(vs.name);
        for (auto& [var, shadow] : shadows) {
          if (var == v) vs.shadow = shadow;
        }
      }
      if (keep_committed_) committed_ = *snapshot;  // shares the buffers
    } else if (snapshot_requested_ && averages_pending_ == 0 && step_takes_begun_ == 0) {
      // Every commit's averages are in (this one's or a later one's, whichever relocks last): the
      // snapshot is of the current step, consistent.
      asked = TrySnapshotLocked(step, true);
    }
  }
  if (snapshot && checkpoint) asked = std::move(snapshot);
  if (asked && on_snapshot_) on_snapshot_(std::move(*asked));
  if (on_commit_) on_commit_(info);
  // Gradients for the new step may already be waiting (pushed with a future local step, or the
  // requirement shrank); take them now rather than on the next push.
  ReevaluateAll();
  ReportIfIdle();
}

TrainingEngine::AveragesTurn TrainingEngine::TakeAveragesTurnLocked(int64_t step) {
  AveragesTurn turn{0, step, {}};
  for (auto& [name, v] : vars_) {
    if (!v->average) continue;
    AwaitInPlaceWriteLocked(v.get());
    turn.values.emplace_back(v.get(), v->published);
  }
  turn.ticket = averages_issued_++;  // last: a ticket issued is always served (nothing throws after)
  return turn;
}

std::vector<std::pair<TrainingEngine::Variable*, std::shared_ptr<Buffer>>> TrainingEngine::UpdateAverages(
    AveragesTurn turn) {
  // TF ExponentialMovingAverage: decay = min(decay, (1 + n) / (10 + n)) with num_updates n.
  double decay = config_.ema_decay;
  if (config_.ema_num_updates) {
    float n = static_cast<float>(turn.step);
    decay = std::min(decay, static_cast<double>((1.0f + n) / (10.0f + n)));
  }
  MutexLock order(&averages_mu_);
  while (averages_served_ != turn.ticket) averages_turn_.Wait(&averages_mu_);
  // Served however this ends: every later commit waits for it.
  ScopeExit served([this]() NO_THREAD_SAFETY_ANALYSIS {  // averages_mu_ is held: `order` ends after this
    ++averages_served_;
    averages_turn_.NotifyAll();
  });
  std::vector<std::pair<Variable*, std::shared_ptr<Buffer>>> shadows;
  for (auto& [v, value] : turn.values) {
    std::shared_ptr<const Buffer> old;
    {
      MutexLock lock(&mu_);
      old = v->shadow;
    }
    std::shared_ptr<Buffer> next;
    try {
      next = std::make_shared<Buffer>(v->bytes);
    } catch (const std::bad_alloc&) {
      continue;  // out of memory: this average misses the step (the step itself is committed)
    }
    int64_t n = NumElements(v->shape);
    if (v->dtype == DType::kFloat32) {
      const float* s = old->as<float>();
      const float* x = value->as<float>();
      float* o = next->as<float>();
      float a = static_cast<float>(1 - decay);
      for (int64_t i = 0; i < n; ++i) o[i] = s[i] - a * (s[i] - x[i]);
    } else {
      const double* s = old->as<double>();
      const double* x = value->as<double>();
      double* o = next->as<double>();
      for (int64_t i = 0; i < n; ++i) o[i] = s[i] - (1 - decay) * (s[i] - x[i]);
    }
    shadows.emplace_back(v, next);
    MutexLock lock(&mu_);
    v->shadow = std::move(next);
  }
  return shadows;
}

bool TrainingEngine::DeferTakeLocked(Variable* v, bool forced) {
  const int64_t step = global_step_.load();
  if (take_deferred_logged_.exchange(step) != step) {
    spdlog::warn(
        "step {}: out of memory for the sum of variable '{}' ({} bytes) at its take; the step stays open "
        "and the take is tried again (is --max-model-bytes above the memory this host has?)",
        step, v->name, v->bytes);
  }
  if (forced) take_deferred_forced_step_.store(step);
  ArmRetry(forced ? 2 : 1);
  return false;
}

void TrainingEngine::ArmRetry(int level) {
  int was = take_deferred_.load();
  while (was < level && !take_deferred_.compare_exchange_weak(was, level)) {
  }
  try {
    if (on_take_deferred_) {
      on_take_deferred_();
      return;
    }
  } catch (const std::bad_alloc&) {
  }
  retry_unarmed_.store(true);  // no retry armed: RetryIfUnarmed tries again
}

void TrainingEngine::RetryDeferredTakes() {
  const int deferred = take_deferred_.exchange(0);
  if (deferred == 0) return;
  {
    // Every variable taken, the commit found no memory (DeferCommitLocked): it is tried again.
    MutexLock lock(&mu_);
    if (commit_deferred_ != 0 && pending_takes_ == 0) {
      const bool forced = commit_deferred_ == 2;
      commit_deferred_ = 0;
      return StepReadyLocked(lock, forced);  // committed: it took what waits for the next step
    }
  }
  // Forced only if that step is still open (ForceStep checks): a later one has its own deadline.
  if (deferred == 2) ForceStep(take_deferred_forced_step_.load());
  ReevaluateAll();
}

void TrainingEngine::ReevaluateAll() {
  if (config_.mode != Mode::kSync) return;
  for (Variable* v : Variables(/*trainable_only=*/true)) {
    bool took = false;
    int count = 0;
    {
      MutexLock lock(&v->mu);
      took = MaybeTakeLocked(v, false, &count);
    }
    if (took) OnTaken(count);
  }
}

void TrainingEngine::ForceStep(int64_t step) {
  if (config_.mode != Mode::kSync || global_step_.load() != step) return;
  int forced = 0;
  for (Variable* v : Variables(/*trainable_only=*/true)) {
    bool took = false;
    int count = 0;
    {
      MutexLock lock(&v->mu);
      if (global_step_.load() != step) return;
      took = MaybeTakeLocked(v, true, &count);
    }
    if (took) {
      ++forced;
      MutexLock lock(&mu_);
      step_min_count_ = std::min(step_min_count_, count);
      step_max_count_ = std::max(step_max_count_, count);
      ++step_takes_;
      if (--pending_takes_ > 0) continue;
      StepReadyLocked(lock, true);
    }
  }
  if (forced > 0) spdlog::info("step {} forced by the step deadline", step + 1);
}

}  // namespace psd::server
