// TrainingEngine: the variable store, pushes (validation and accumulation) and reads.
#include "core/training_engine.h"

#include "base/scope_exit.h"
#include "core/training_engine_internal.h"
#include "psd/cores.h"

namespace psd::server {

using namespace engine_internal;

const char* AggregationName(Aggregation a) {
  switch (a) {
    case Aggregation::kNone:
      return "NONE";
    case Aggregation::kSum:
      return "SUM";
    case Aggregation::kMean:
      return "MEAN";
    case Aggregation::kOnlyFirstReplica:
      return "ONLY_FIRST_REPLICA";
  }
  return "NONE";
}

Result<Aggregation> AggregationFromNumber(int value) {
  if (value >= 0 && value <= static_cast<int>(Aggregation::kOnlyFirstReplica)) return static_cast<Aggregation>(value);
  return InvalidArgument("unknown variable aggregation " + std::to_string(value) +
                         "; the valid ones are NONE (0), SUM (1), MEAN (2) and ONLY_FIRST_REPLICA (3)");
}

// The gradient kinds one push claimed (TrainingEngine::Push). Claim and Use run with no variable
// lock held / with the variable's lock held respectively; unused claims are released when the
// push returns, each under its own variable's lock (never two variable locks at once).
class TrainingEngine::KindClaims {
 public:
  explicit KindClaims(const std::vector<Variable*>& vars) : vars_(vars), held_(vars.size(), false) {}
  KindClaims(const KindClaims&) = delete;
  KindClaims& operator=(const KindClaims&) = delete;
  ~KindClaims() {
    for (size_t i = 0; i < vars_.size(); ++i) {
      if (!held_[i]) continue;
      Variable* v = vars_[i];
      MutexLock lock(&v->mu);
      if (--v->kind_claims == 0 && !v->kind_fixed) v->kind = GradKind::kUnknown;
    }
  }

  // Claims `want` for variable i (locks it), or InvalidArgument if it takes the other kind.
  Status Claim(size_t i, GradKind want) {
    Variable* v = vars_[i];
    MutexLock lock(&v->mu);
    if (v->kind != GradKind::kUnknown && v->kind != want) {
      return InvalidArgument("variable '" + v->name + "' takes " + KindName(v->kind) + " gradients; got a " +
                             KindName(want) + " one");
    }
    v->kind = want;
    if (!v->kind_fixed) {
      ++v->kind_claims;
      held_[i] = true;
    }
    return Status::Ok();
  }

  // With variable i's lock held: its gradient is being used, so its kind is fixed for good.
  void Use(size_t i, Variable* v) REQUIRES(v->mu) {
    assert(v == vars_[i]);
    if (held_[i]) {
      --v->kind_claims;
      held_[i] = false;
    }
    v->kind_fixed = true;
  }

 private:
  const std::vector<Variable*>& vars_;
  std::vector<bool> held_;
};

Status ValidateName(std::string_view name) {
  if (name.empty() || name.size() > 256) {
    return InvalidArgument("name must have 1 to 256 characters, got " + std::to_string(name.size()));
  }
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
              c == '/' || c == ':' || c == '-';
    if (!ok) return InvalidArgument("name has a character outside [A-Za-z0-9_./:-]");
  }
  return Status::Ok();
}

TrainingEngine::TrainingEngine(const TrainingConfig& config, std::unique_ptr<Optimizer> optimizer)
    : config_(config),
      optimizer_(std::move(optimizer)),
      pool_(ThreadsOrCores(config.apply_threads) - 1),
      required_(config.InitialRequiredReplicas()),
      next_lr_(config.optimizer.learning_rate),
      step_lr_(config.optimizer.learning_rate) {}

TrainingEngine::~TrainingEngine() = default;

void TrainingEngine::PushInitTokens(int count) {
  if (count > 0) tokens_.PushInit(global_step_.load(), count);
}

TrainingEngine::Variable* TrainingEngine::FindLocked(std::string_view name) const {
  auto it = vars_.find(name);
  return it == vars_.end() ? nullptr : it->second.get();
}

Result<VariableDesc> TrainingEngine::CreateVariable(const VariableDef& def) {
  PSD_RETURN_IF_ERROR(ValidateName(def.name));
  // Bigger than a frame is fine (gradients travel in chunks); --max-model-bytes bounds it below.
  PSD_RETURN_IF_ERROR(ValidateShape(def.shape, def.dtype, std::max(config_.max_frame_bytes, config_.max_model_bytes)));
  const DType compute = ComputeDType(def.dtype);
  const size_t elements = static_cast<size_t>(NumElements(def.shape));
  size_t bytes = elements * DTypeSize(compute);
  if (def.adopt && def.adopt->bytes() != bytes) {
    return InvalidArgument("restored value of '" + def.name + "' has " + std::to_string(def.adopt->bytes()) +
                           " bytes, shape " + ShapeString(def.shape) + " of " + DTypeName(compute) + " needs " +
                           std::to_string(bytes));
  }
  const DType initial_dtype = def.initial_dtype.value_or(def.dtype);
  if (def.initial != nullptr && !ConvertibleDTypes(initial_dtype, def.dtype)) {
    return InvalidArgument("initial value of '" + def.name + "' is " + DTypeName(initial_dtype) + "; the variable is " +
                           DTypeName(def.dtype));
  }
  if (def.initial != nullptr && def.initial_bytes != elements * DTypeSize(initial_dtype)) {
    return InvalidArgument("initial value of '" + def.name + "' has " + std::to_string(def.initial_bytes) +
                           " bytes, shape " + ShapeString(def.shape) + " of " + DTypeName(initial_dtype) + " needs " +
                           std::to_string(elements * DTypeSize(initial_dtype)));
  }
  if (def.sync_on_read && def.trainable) {
    return InvalidArgument("variable '" + def.name + "' is sync-on-read: create it with trainable = false");
  }
  if (def.sync_on_read && def.aggregation == Aggregation::kNone) {
    return InvalidArgument("sync-on-read variable '" + def.name +
                           "' needs aggregation SUM, MEAN or ONLY_FIRST_REPLICA");
  }
  if (def.average && config_.ema_decay <= 0) {
    return FailedPrecondition("variable '" + def.name +
                              "' asks for a moving average but psd runs without "
                              "--ema-decay");
  }
  MutexLock lock(&mu_);
  if (Variable* v = FindLocked(def.name)) {
    if (v->declared != def.dtype || v->shape != def.shape || v->trainable != def.trainable ||
        v->average != def.average || v->optimizer_name != def.optimizer || v->aggregation != def.aggregation ||
        v->sync_on_read != def.sync_on_read) {
      auto describe = [](DType d, const Shape& s, bool t, bool a, const std::string& o) {
        return std::string(DTypeName(d)) + " " + ShapeString(s) + (t ? " trainable" : " non-trainable") +
               (a ? " averaged" : "") + (o.empty() ? "" : " optimizer=" + o);
      };
      return AlreadyExists("variable '" + def.name + "' exists as " +
                           describe(v->declared, v->shape, v->trainable, v->average, v->optimizer_name) +
                           "; requested " + describe(def.dtype, def.shape, def.trainable, def.average, def.optimizer));
    }
    return VariableDesc{v->name, v->declared, v->shape, v->trainable, false};
  }
  const Optimizer* opt = optimizer_.get();
  if (!def.optimizer.empty() && def.optimizer != optimizer_->name()) {
    auto it = per_variable_optimizers_.find(def.optimizer);
    if (it == per_variable_optimizers_.end()) {
      OptimizerParams p = config_.optimizer;
      p.name = def.optimizer;
      auto made = MakeOptimizer(p);
      if (!made.ok()) return made.status();
      it = per_variable_optimizers_.emplace(def.optimizer, std::move(*made)).first;
    }
    opt = it->second.get();
  }
  // What a variable costs: its value (and a staging/spare copy and an accumulator when it trains),
  // its slots, its average, a sync-on-read variable's value per replica, and its bookkeeping (so
  // that millions of empty variables are refused too). Checked before allocating: a peer cannot
  // exhaust the daemon's memory.
  const uint64_t copies = 1 + (def.trainable ? 3 : 0) + opt->Slots().size() + (def.average ? 1 : 0) +
                          (def.sync_on_read ? 1 + static_cast<uint64_t>(config_.worker_slots()) : 0);
  const uint64_t cost = bytes > (UINT64_MAX - kVariableOverheadBytes) / copies
                            ? UINT64_MAX  // saturated: over any --max-model-bytes
                            : bytes * copies + kVariableOverheadBytes;
  uint64_t held = 0;
  if (!ChargeModelBytes(cost, &held, /*with_reserved=*/false)) {
    return ResourceExhausted("variable '" + def.name + "' needs about " + std::to_string(cost) + " bytes; the " +
                             "variables already hold " + std::to_string(held) + " of --max-model-bytes " +
                             std::to_string(config_.max_model_bytes));
  }
  value_bytes_.fetch_add(bytes);
  // A trainable variable created after the open step was reported (or while its commit waits for
  // memory: DeferCommitLocked) joins the next step.
  const int64_t step = global_step_.load();
  const bool joins_next =
      def.trainable && config_.mode == Mode::kSync && ((prepared_ && step_takes_ > 0) || commit_deferred_ != 0);
  auto v = std::make_unique<Variable>(def, opt, step, joins_next ? step + 1 : step);
  if (def.adopt) {
    v->published = std::const_pointer_cast<Buffer>(def.adopt);
  } else {
    v->published = std::make_shared<Buffer>(bytes);
    if (def.initial != nullptr) ConvertElements(def.initial, initial_dtype, v->published->data(), compute, elements);
  }
  if (v->average) v->shadow = std::make_shared<Buffer>(*v->published);  // TF: shadow = initial value
  if (v->sync_on_read) v->replica_base = std::make_shared<Buffer>(*v->published);
  if (v->trainable && config_.mode == Mode::kSync && !joins_next) {
    // An idle report (nothing to take) is withdrawn: this variable's take will report again.
    prepared_ = false;
    ++pending_takes_;
  }
  VariableDesc desc{v->name, v->declared, v->shape, v->trainable, true};
  vars_.emplace(def.name, std::move(v));
  variable_count_.store(static_cast<int>(vars_.size()));
  lock.Unlock();
  spdlog::info("created variable '{}' {} {}{}{}", def.name, DTypeName(def.dtype), ShapeString(def.shape),
               def.trainable ? "" : " (non-trainable)", def.average ? " (averaged)" : "");
  return desc;
}

Status TrainingEngine::ValidateGrad(Variable* v, const GradRef& g) const {
  if (g.sparse()) {
    // Once gradients are accumulating TF words the values checks against the accumulated ones.
    bool accumulating = false;
    {
      MutexLock lock(&v->mu);
      accumulating = v->sparse && v->sparse->num_accumulated() > 0;
    }
    return SparseAccumulator::Check(v->dtype, v->shape,
                                    {g.indices, g.nnz, g.dtype, g.shape, g.data, g.bytes, g.dense_shape}, accumulating);
  }
  if (g.chunk()) return DenseAccumulator::CheckChunk(v->dtype, v->shape, g.dtype, g.shape, g.bytes, g.chunk_offset);
  return DenseAccumulator::Check(v->dtype, v->shape, g.dtype, g.shape, g.bytes);
}

bool TrainingEngine::ChargeModelBytes(uint64_t cost, uint64_t* held, bool with_reserved) {
  *held = model_bytes_.load();
  for (;;) {
    // An initial value arriving in chunks holds its reservation until its variable is created
    // (and charged in full): the variable's own charge does not count it twice.
    const uint64_t reserved = with_reserved ? reserved_value_bytes_->load() : 0;
    const uint64_t limit = config_.max_model_bytes;
    if (cost > limit || *held > limit - cost || reserved > limit - cost - *held) return false;
    if (model_bytes_.compare_exchange_weak(*held, *held + cost)) return true;
  }
}

Status TrainingEngine::ChargeSparseBookkeeping(Variable* v) {
  // Every sparse push asks: once charged, without the lock a merge of other workers' rows holds.
  if (v->sparse_charged.load(std::memory_order_acquire)) return Status::Ok();
  MutexLock lock(&v->mu);
  if (v->sparse_charged.load(std::memory_order_relaxed)) return Status::Ok();
  PSD_RETURN_IF_ERROR(SparseAccumulator::CheckRows(v->shape));
  // Charged once, and kept (as the variable's own charge is) even if a dense gradient fixes its
  // kind after this push fails.
  const uint64_t cost = SparseAccumulator::BookkeepingBytes(v->shape[0]);  // validated: rank >= 1
  uint64_t held = 0;
  if (!ChargeModelBytes(cost, &held, /*with_reserved=*/true)) {
    return ResourceExhausted("variable '" + v->name + "': accumulating sparse gradients needs about " +
                             std::to_string(cost) + " bytes more for its " + std::to_string(v->shape[0]) +
                             " rows' bookkeeping; the variables already hold " + std::to_string(held) +
                             " of --max-model-bytes " + std::to_string(config_.max_model_bytes) +
                             ": raise it, or send this variable dense gradients");
  }
  v->sparse_charged.store(true, std::memory_order_release);
  return Status::Ok();
}

void TrainingEngine::DropUnfinishedChunks(uint64_t source) {
  if (source == 0) return;
  for (Variable* v : Variables()) {
    MutexLock lock(&v->mu);
    if (v->dense && config_.deterministic) v->dense->DropUnfinished(source);
    if (v->sparse) {
      v->sparse->DropUnfinished(source);
      SettleStagingLocked(v);
    }
  }
}

void TrainingEngine::SettleStagingLocked(Variable* v) {
  // Exact either way: what is held is what was reserved (an accumulator replaced meanwhile may
  // keep a little more of a push's rows than was reserved for them).
  const uint64_t held = (v->sparse ? v->sparse->StagedBytes() : 0) + v->staging_adding + v->staging_reserved;
  if (held > v->staging_charged) model_bytes_.fetch_add(held - v->staging_charged);
  if (held < v->staging_charged) model_bytes_.fetch_sub(v->staging_charged - held);
  v->staging_charged = held;
}

int64_t TrainingEngine::LastSparseGranuleRows(std::string_view name) const {
  MutexLock lock(&mu_);
  const Variable* v = FindLocked(name);
  return v == nullptr ? 0 : v->pending_granule_rows;
}

std::optional<VariableDesc> TrainingEngine::Describe(std::string_view name) const {
  MutexLock lock(&mu_);
  Variable* v = FindLocked(name);
  if (v == nullptr) return std::nullopt;
  return VariableDesc{v->name, v->declared, v->shape, v->trainable, false};
}

Result<std::shared_ptr<void>> TrainingEngine::ReserveValueBytes(const std::string& name, uint64_t bytes) {
  // Checked and taken in one step (connections on several I/O threads reserve at once).
  uint64_t reserved = reserved_value_bytes_->load();
  for (;;) {
    const uint64_t held = model_bytes_.load() + reserved;
    if (bytes > config_.max_model_bytes || held > config_.max_model_bytes - bytes) {
      return ResourceExhausted("variable '" + name + "': its initial value of " + std::to_string(bytes) +
                               " bytes does not fit: the variables and the initial values arriving in chunks "
                               "already hold " +
                               std::to_string(held) + " of --max-model-bytes " +
                               std::to_string(config_.max_model_bytes));
    }
    if (reserved_value_bytes_->compare_exchange_weak(reserved, reserved + bytes)) break;
  }
  return std::shared_ptr<void>(nullptr,
                               [reserved = reserved_value_bytes_, bytes](void*) { reserved->fetch_sub(bytes); });
}

Status TrainingEngine::Push(int64_t local_step, const std::vector<GradRef>& grads, std::vector<GradOutcome>* out,
                            std::string_view replica, bool more) {
  std::vector<Variable*> targets;
  targets.reserve(grads.size());
  {
    MutexLock lock(&mu_);
    for (const GradRef& g : grads) {
      Variable* v = FindLocked(g.name);
      if (v == nullptr) return NotFound("no variable named '" + std::string(g.name) + "'");
      if (!v->trainable) return InvalidArgument("variable '" + v->name + "' is not trainable");
      if (std::find(targets.begin(), targets.end(), v) != targets.end()) {
        return InvalidArgument("variable '" + v->name + "' appears twice in one push");
      }
      targets.push_back(v);
    }
  }
  // Half-precision gradients for float32 accumulation: sparse ones, and async/ssp applies, are
  // converted to float32 first (once, here).
  ConvertedInputs converted;
  std::vector<GradRef> mixed;
  const std::vector<GradRef>* use = &grads;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].dtype == targets[i]->dtype) continue;
    // Sync dense gradients are converted by the accumulator as they are added (one pass).
    if (config_.mode == Mode::kSync && !grads[i].sparse()) continue;
    if (mixed.empty()) mixed = grads;
    Status s = converted.Convert(&mixed[i], targets[i]->declared, targets[i]->dtype);
    if (!s.ok()) return Status(s.code(), "gradient for '" + targets[i]->name + "': " + s.message());
    use = &mixed;
  }
  PSD_RETURN_IF_ERROR(PushConverted(local_step, *use, targets, out, replica, more));
  // A take or a commit that ran out of memory and whose retry could not be armed (ArmRetry: that
  // allocation failed too) is tried again after each push.
  RetryIfUnarmed();
  // Async/ssp on one daemon: a push that claims a multiple of --checkpoint-every-steps snapshots
  // (a cluster's chief orders its shards' snapshots instead, coordinator.h).
  const int64_t every = config_.checkpoint_every_steps;
  if (config_.mode != Mode::kSync && !more && every > 0 && on_snapshot_ && !out->empty() &&
      commit_->commits_locally() && ((*out)[0].step + 1) % every == 0) {
    RequestSnapshot();
  }
  return Status::Ok();
}

namespace {

static_assert(TrainingEngine::kChunkElements == DenseAccumulator::kPartElements,
              "a chunk aligns to the accumulator's parts");

// A whole gradient, or the last chunk of one: what the accepted/stale counters count.
bool CompletesGradient(const GradRef& g, const Shape& shape) {
  if (g.rows_more) return false;
  return !g.chunk() || g.chunk_offset + g.shape[0] == NumElements(shape);
}

}  // namespace

Status TrainingEngine::PushConverted(int64_t local_step, const std::vector<GradRef>& grads,
                                     const std::vector<Variable*>& targets, std::vector<GradOutcome>* out,
                                     std::string_view replica, bool more) {
  // Validate everything before touching any accumulator: a bad push changes nothing. Each
  // variable's gradient kind is claimed while its lock is held (released on every way out).
  KindClaims claims(targets);
  // Sync: what each sparse gradient's rows add to those kept for a gradient sent in several frames,
  // reserved (charged) here and used by its add; given back on every way out for those not added.
  std::vector<uint64_t> staged(grads.size(), 0);
  ScopeExit unreserved([&] {
    for (size_t i = 0; i < staged.size(); ++i) {
      if (staged[i] > 0) ReleaseStaging(targets[i], staged[i]);
    }
  });
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].chunk() && grads[i].sparse()) {
      return InvalidArgument("gradient for '" + targets[i]->name +
                             "': a sparse gradient cannot be a chunk; split its rows over several pushes");
    }
    if (grads[i].rows_more && (!grads[i].sparse() || !more)) {
      return InvalidArgument("gradient for '" + targets[i]->name +
                             "': more rows can only follow a sparse gradient's rows in a later frame of the push "
                             "(Push.more)");
    }
    Status s = ValidateGrad(targets[i], grads[i]);
    if (!s.ok()) return Status(s.code(), "gradient for '" + targets[i]->name + "': " + s.message());
    PSD_RETURN_IF_ERROR(claims.Claim(i, grads[i].sparse() ? GradKind::kSparse : GradKind::kDense));
    if (grads[i].sparse() && config_.mode == Mode::kSync) {
      PSD_RETURN_IF_ERROR(ChargeSparseBookkeeping(targets[i]));
      Result<uint64_t> reserved = ReserveStaging(targets[i], grads[i], local_step);
      if (!reserved.ok()) return reserved.status();
      staged[i] = *reserved;
    }
  }
  if (test_hook_) test_hook_("push.validated");
  out->clear();
  out->reserve(grads.size());
  if (config_.mode != Mode::kSync) {
    // Async / bounded staleness: apply now; the whole push is one global step. The step is
    // claimed first, so concurrent single-frame pushes get distinct steps (Adam's t does not
    // repeat). A push sent in several frames claims its step with its last frame; the frames
    // before apply at the step after the current one, which a concurrent push may claim too.
    int64_t global = more ? global_step_.load() : global_step_.fetch_add(1);
    int64_t step = global + 1;
    int64_t staleness = StalenessOf(global, local_step);
    double lr = next_lr_.load();
    if (config_.staleness_lr == StalenessLr::kInverse) lr /= static_cast<double>(std::max<int64_t>(1, staleness));
    if (config_.staleness_lr == StalenessLr::kWorkers) lr /= static_cast<double>(std::max(1, config_.total_replicas));
    for (size_t i = 0; i < grads.size(); ++i) {
      Variable* v = targets[i];
      MutexLock vlock(&v->mu);
      claims.Use(i, v);
      ApplyNowLocked(v, grads[i], step, lr);
      out->push_back({true, global, staleness});
      if (CompletesGradient(grads[i], v->shape)) accepted_.fetch_add(1);
    }
    if (more) return Status::Ok();
    int64_t seen = max_staleness_.load();
    while (staleness > seen && !max_staleness_.compare_exchange_weak(seen, staleness)) {
    }
    if (config_.ema_decay > 0) {
      AveragesTurn turn;
      {
        MutexLock lock(&mu_);
        turn = TakeAveragesTurnLocked(step);
      }
      UpdateAverages(std::move(turn));
    }
    if (on_commit_) on_commit_({step, 1, 1, false});
    return Status::Ok();
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    Variable* v = targets[i];
    const GradRef& g = grads[i];
    bool took = false, started = false;
    int count = 0;
    std::exception_ptr failed;  // the add threw (out of memory): it does not count
    {
      MutexLock lock(&v->mu);
      claims.Use(i, v);
      const uint64_t reserved = std::exchange(staged[i], 0);  // AddSparseLocked uses it
      Result<bool> accepted = g.sparse() ? AddSparseLocked(v, g, local_step, reserved, &failed)
                                         : AddDenseLocked(v, g, local_step, replica, &failed);
      if (!accepted.ok()) return accepted.status();
      if (failed) {
        // The push fails; the add that failed may have been the last in flight of a step whose
        // gradients are all in (an add that ended before it left the take to it): that step takes.
        took = MaybeTakeLocked(v, false, &count);
      } else {
        int64_t acc_step = v->acc_step();
        out->push_back({*accepted, acc_step, StalenessOf(global_step_.load(), local_step)});
        const bool completes = CompletesGradient(g, v->shape);
        if (*accepted) {
          if (completes) accepted_.fetch_add(1);
          took = MaybeTakeLocked(v, false, &count);
          if (!took && on_step_started_) {
            MutexLock elock(&mu_);
            if (!step_started_) started = step_started_ = true;
          }
        } else if (completes) {
          stale_.fetch_add(1);
        }
      }
    }
    if (started) on_step_started_(global_step_.load());
    if (took) OnTaken(count);
    if (failed) std::rethrow_exception(failed);
  }
  return Status::Ok();
}

Result<uint64_t> TrainingEngine::ReserveStaging(Variable* v, const GradRef& g, int64_t local_step) {
  MutexLock lock(&v->mu);
  if (!v->sparse) v->sparse = NewSparseAccumulator(*v, v->next_take_step);
  const uint64_t grows = v->sparse->StagingGrowth(
      local_step, {g.indices, g.nnz, g.dtype, g.shape, g.data, g.bytes, g.dense_shape}, !g.rows_more, g.source);
  if (grows == 0) return uint64_t{0};
  uint64_t held = 0;
  if (!ChargeModelBytes(grows, &held, /*with_reserved=*/true)) {
    return ResourceExhausted("variable '" + v->name + "': a sparse gradient sent in several frames is kept until " +
                             "its last frame, and its rows so far need " + std::to_string(grows) +
                             " bytes more; the variables already hold " + std::to_string(held) +
                             " of --max-model-bytes " + std::to_string(config_.max_model_bytes) +
                             ": raise it, or send fewer rows in one push");
  }
  v->staging_charged += grows;
  v->staging_reserved += grows;
  return grows;
}

void TrainingEngine::ReleaseStaging(Variable* v, uint64_t reserved) {
  MutexLock lock(&v->mu);
  v->staging_reserved -= reserved;
  SettleStagingLocked(v);
}

Result<bool> TrainingEngine::AddSparseLocked(Variable* v, const GradRef& g, int64_t local_step, uint64_t reserved,
                                             std::exception_ptr* failed) {
  const SparseGradRef ref{g.indices, g.nnz, g.dtype, g.shape, g.data, g.bytes, g.dense_shape};
  const bool counts = !g.rows_more;
  // The rows of a gradient sent in several frames are kept until its last: what this one's add to
  // them was reserved (charged) at validation, and is now what they hold (SettleStagingLocked).
  v->staging_reserved -= reserved;
  if (!v->sparse) {  // made at validation (ReserveStaging): only if that was skipped
    v->sparse = NewSparseAccumulator(*v, v->next_take_step);
  }
  SparseAccumulator::PendingAdd add;
  Result<bool> accepted = v->sparse->BeginAdd(local_step, ref, counts, g.source, &add);  // validated before
  const uint64_t whole = SparseAccumulator::HeldBytes(add);
  v->staging_adding += whole;
  SettleStagingLocked(v);
  if (accepted.ok() && add.add) {
    // As a dense add: its rows are added without the variable's lock, in parallel with other
    // workers' (striped by rows); the take waits for it (in_flight), and the accumulator is not
    // replaced meanwhile.
    SparseAccumulator* acc = v->sparse.get();
    v->mu.Unlock();
    try {
      acc->Add(add);
    } catch (...) {
      *failed = std::current_exception();
    }
    v->mu.Lock();
    if (*failed) {
      acc->CancelAdd();
    } else {
      acc->EndAdd();
    }
    if (AddsInFlightLocked(v) == 0) v->adds_done.NotifyAll();
  }
  // The whole gradient's rows go, and their charge with them.
  add = SparseAccumulator::PendingAdd();
  v->staging_adding -= whole;
  SettleStagingLocked(v);
  return accepted;
}

Result<bool> TrainingEngine::AddDenseLocked(Variable* v, const GradRef& g, int64_t local_step, std::string_view replica,
                                            std::exception_ptr* failed) {
  if (!v->dense) v->dense = NewDenseAccumulator(*v, v->next_take_step);
  OfferSpareLocked(v);
  Result<bool> accepted = v->dense->BeginAdd(local_step);
  if (!accepted.ok() || !*accepted) return accepted;
  // The add itself runs without the variable's lock, in parallel with other workers' (striped);
  // the step cannot be taken before it ends (in_flight), nor the accumulator replaced, so the
  // pointer stays valid.
  DenseAccumulator* acc = v->dense.get();
  // With few adds of it at once (this one counted), idle apply threads take some of its stripes: a
  // worker's big gradient is added by several cores, as the optimizer applies.
  ThreadPool* helpers = acc->in_flight() <= kHelpedAdds ? &pool_ : nullptr;
  v->mu.Unlock();
  try {
    if (g.chunk()) {
      acc->AddChunk(g.dtype, g.data, g.chunk_offset, g.shape[0], replica, helpers, g.hold,
                    g.source);  // validated before
    } else {
      acc->Add(g.dtype, g.data, replica, helpers, g.hold);
    }
  } catch (...) {  // out of memory (the sum's buffer or a deterministic slot, taken before anything is added):
                   // the push fails, the sum is as if it never came, the step does not hang
    *failed = std::current_exception();
  }
  v->mu.Lock();
  if (*failed) {
    acc->CancelAdd();
  } else if (g.chunk()) {
    acc->EndAddChunk(g.chunk_offset, g.shape[0]);
  } else {
    acc->EndAdd();
  }
  if (AddsInFlightLocked(v) == 0) v->adds_done.NotifyAll();
  return accepted;
}

Status TrainingEngine::Pull(const std::vector<std::string>& names, std::vector<PulledValue>* out, int64_t* step,
                            bool averages) {
  out->clear();
  MutexLock lock(&mu_);
  auto pick = [&](Variable* v) REQUIRES(mu_) -> Status {
    if (!averages) {
      out->push_back({ReadValueLocked(v), v->dtype, v->shape, v->declared, v->name});
      return Status::Ok();
    }
    if (!v->shadow) return NotFound("variable '" + v->name + "' has no moving average");
    out->push_back({v->shadow, v->dtype, v->shape, v->declared, {}});  // averages: not cached
    return Status::Ok();
  };
  if (names.empty()) {
    for (auto& [name, v] : vars_) {
      if (!averages || v->shadow) PSD_RETURN_IF_ERROR(pick(v.get()));
    }
  } else {
    out->reserve(names.size());
    for (const std::string& name : names) {
      Variable* v = FindLocked(name);
      if (v == nullptr) return NotFound("no variable named '" + name + "'");
      PSD_RETURN_IF_ERROR(pick(v));
    }
  }
  *step = global_step_.load();
  return Status::Ok();
}

Result<std::vector<DType>> TrainingEngine::DeclaredDTypes(const std::vector<std::string>& names) const {
  std::vector<DType> out;
  out.reserve(names.size());
  MutexLock lock(&mu_);
  for (const std::string& name : names) {
    Variable* v = FindLocked(name);
    if (v == nullptr) return NotFound("no variable named '" + name + "'");
    out.push_back(v->declared);
  }
  return out;
}

Result<int64_t> TrainingEngine::ReadRows(const std::string& name, const std::vector<int64_t>& rows, RowSink& sink) {
  std::shared_ptr<const Buffer> value;
  DType dtype, declared;
  Shape shape;
  size_t row_bytes = 0;
  int64_t step = 0;
  {
    MutexLock lock(&mu_);
    Variable* v = FindLocked(name);
    if (v == nullptr) return NotFound("no variable named '" + name + "'");
    if (v->shape.empty()) return InvalidArgument("variable '" + name + "' is a scalar: it has no rows");
    for (size_t i = 0; i < rows.size(); ++i) {
      if (rows[i] < 0 || rows[i] >= v->shape[0]) {
        return InvalidArgument("row " + std::to_string(rows[i]) + " (slice " + std::to_string(i) + ") is outside [0, " +
                               std::to_string(v->shape[0]) + ")");
      }
    }
    // Immutable while referenced: a commit that finds it held applies to a copy (engine_step.cc).
    value = ReadValueLocked(v);
    dtype = v->dtype;
    declared = v->declared;
    shape = v->shape;
    row_bytes = static_cast<size_t>(v->row_elements) * DTypeSize(v->dtype);
    step = global_step_.load();
  }
  shape[0] = static_cast<int64_t>(rows.size());
  PSD_RETURN_IF_ERROR(sink.Begin(dtype, declared, shape));
  const uint8_t* src = static_cast<const uint8_t*>(value->data());
  for (size_t i = 0; i < rows.size(); ++i) sink.Row(i, src + static_cast<size_t>(rows[i]) * row_bytes);
  return step;
}

std::vector<std::string> TrainingEngine::SlotNames(const std::string& variable) const {
  MutexLock lock(&mu_);
  Variable* v = FindLocked(variable);
  return v ? v->opt->SlotNames() : optimizer_->SlotNames();
}

Result<PulledValue> TrainingEngine::GetSlot(const std::string& variable, const std::string& slot, int64_t offset,
                                            int64_t count) {
  Variable* v = nullptr;
  {
    MutexLock lock(&mu_);
    v = FindLocked(variable);
  }
  if (v == nullptr) return NotFound("no variable named '" + variable + "'");
  auto names = v->opt->SlotNames();
  auto it = std::find(names.begin(), names.end(), slot);
  if (it == names.end()) {
    return NotFound("optimizer '" + v->opt->name() + "' of '" + variable + "' has no slot '" + slot + "'");
  }
  const int64_t elements = NumElements(v->shape);
  const bool ranged = count >= 0;
  if (ranged && (offset < 0 || count <= 0 || offset >= elements || count > elements - offset)) {
    return InvalidArgument("elements [" + std::to_string(offset) + ", +" + std::to_string(count) + ") of slot '" +
                           slot + "' of '" + variable + "' are outside its " + std::to_string(elements) + " elements");
  }
  // Only the elements asked for: a slot bigger than a reply is read in ranges, and a whole copy per
  // range was quadratic (a 64 MiB slot in 1 MiB ranges copied 4 GiB, the engine's lock held).
  const size_t es = DTypeSize(v->dtype);
  const size_t first = ranged ? static_cast<size_t>(offset) * es : 0;
  const size_t bytes = ranged ? static_cast<size_t>(count) * es : v->bytes;
  auto copy = std::make_shared<Buffer>(bytes, Buffer::Uninitialized{});
  MutexLock vlock(&v->mu);
  MutexLock lock(&mu_);  // sparse variables' slots are guarded by mu_
  // Read only: the slot's change list (replication) stays.
  const Buffer& from = v->slots[static_cast<size_t>(it - names.begin())];
  std::memcpy(copy->data(), static_cast<const uint8_t*>(from.data()) + first, bytes);
  return PulledValue{std::move(copy), v->dtype, ranged ? Shape{count} : v->shape, v->declared};
}

void TrainingEngine::SetRequiredReplicas(int required) {
  required = std::max(required, 1);
  if (required_.exchange(required) != required) {
    spdlog::info("a step now needs {} fresh gradient(s) per variable", required);
    ReevaluateAll();
    CompleteLoweredRounds();  // reduce_to and update rounds wait for the same count
  }
}

Status TrainingEngine::SetLearningRate(double lr) {
  if (!(lr > 0) || !std::isfinite(lr)) return InvalidArgument("learning rate must be a positive number");
  next_lr_.store(lr);
  spdlog::info("learning rate set to {} from step {}", lr, global_step_.load() + (config_.mode == Mode::kSync ? 2 : 1));
  return Status::Ok();
}

EngineStats TrainingEngine::Counters() const {
  EngineStats s{};
  s.accepted = accepted_.load();
  s.stale = stale_.load();
  s.max_staleness = max_staleness_.load();
  return s;
}

EngineStats TrainingEngine::Stats() const {
  EngineStats s{};
  s.global_step = global_step_.load();
  s.accepted = accepted_.load();
  s.stale = stale_.load();
  s.tokens_queued = tokens_.size();
  s.required_replicas = required_.load();
  s.last_step_gradients = last_step_gradients_.load();
  s.max_staleness = max_staleness_.load();
  s.variables = variable_count_.load();
  s.model_bytes = model_bytes_.load();
  return s;
}

}  // namespace psd::server
