#include "core/training_engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cassert>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <deque>

#include "psd/half.h"
#include "core/accumulator.h"
#include "core/sparse_accumulator.h"

namespace psd::server {
namespace {

constexpr int64_t kParallelApplyElements = 1 << 20;  // split applies of variables bigger than this

enum class GradKind { kUnknown, kDense, kSparse };

const char* KindName(GradKind k) { return k == GradKind::kSparse ? "sparse" : "dense"; }

void Scale(DType dtype, void* data, int64_t n, double factor) {
  if (dtype == DType::kFloat32) {
    float* d = static_cast<float*>(data);
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<float>(d[i] * factor);
  } else {
    double* d = static_cast<double*>(data);
    for (int64_t i = 0; i < n; ++i) d[i] *= factor;
  }
}

// Values that arrive in another dtype than their variable computes in (half-precision gradients or
// values for float32 variables, float32 ones for half variables) are converted once, here, before
// validation and accumulation; the copies live as long as this object.
class ConvertedInputs {
 public:
  // Points `g` at a copy in `compute` when its dtype differs and converts (ConvertibleDTypes);
  // leaves it alone otherwise (validation then reports a mismatch in TF's words).
  Status Convert(GradRef* g, DType declared, DType compute) {
    if (g->dtype == compute || !ConvertibleDTypes(g->dtype, declared)) return Status::Ok();
    uint64_t n = static_cast<uint64_t>(NumElements(g->shape));
    if (g->bytes != n * DTypeSize(g->dtype)) {
      return InvalidArgument("data has " + std::to_string(g->bytes) + " bytes, shape " + ShapeString(g->shape) +
                             " of " + DTypeName(g->dtype) + " needs " + std::to_string(n * DTypeSize(g->dtype)));
    }
    store_.emplace_back((n * DTypeSize(compute) + 7) / 8);  // 8-byte aligned
    ConvertElements(g->data, g->dtype, store_.back().data(), compute, n);
    g->data = store_.back().data();
    g->bytes = n * DTypeSize(compute);
    g->dtype = compute;
    return Status::Ok();
  }

 private:
  std::deque<std::vector<uint64_t>> store_;
};

}  // namespace

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

// One round of replica contributions to a variable (reduce_to, or an aggregated assignment):
// the sum (and, for NONE, the first value and whether any differed) of the values tagged with
// this round's step or later. Guarded by the variable's `mu`.
struct Round {
  using Waiter = std::function<void(const Status&, int64_t step, std::shared_ptr<const Buffer> value)>;
  int64_t step = 0;
  int count = 0;
  bool mean = false;                // reduce: the first contributor's op
  UpdateOp op = UpdateOp::kAssign;  // update: the first contributor's op
  std::vector<uint64_t> sum;        // 8-byte aligned
  std::vector<uint64_t> first;      // aggregation NONE: the first value
  bool disagree = false;
  std::vector<Waiter> waiters;
};

struct TrainingEngine::Variable {
  // `step`: the global step now (rounds start there); `take_step`: the step it is taken for first.
  Variable(const VariableDef& def, const Optimizer* optimizer, int64_t step, int64_t take_step)
      : name(def.name),
        dtype(ComputeDType(def.dtype)),
        declared(def.dtype),
        shape(def.shape),
        trainable(def.trainable),
        average(def.average),
        optimizer_name(def.optimizer),
        placement(def.placement),
        aggregation(def.aggregation),
        sync_on_read(def.sync_on_read),
        bytes(static_cast<size_t>(NumElements(def.shape)) * DTypeSize(ComputeDType(def.dtype))),
        row_elements(def.shape.empty() ? 1 : NumElements(Shape(def.shape.begin() + 1, def.shape.end()))),
        opt(optimizer),
        next_take_step(take_step) {
    reduce_round.step = update_round.step = step;
    for (const SlotSpec& spec : opt->Slots()) {
      slots.emplace_back(bytes);
      if (spec.initial != 0) {
        int64_t n = NumElements(shape);
        if (dtype == DType::kFloat32) {
          std::fill(slots.back().as<float>(), slots.back().as<float>() + n, static_cast<float>(spec.initial));
        } else {
          std::fill(slots.back().as<double>(), slots.back().as<double>() + n, spec.initial);
        }
      }
    }
  }

  const std::string name;
  const DType dtype;     // what the engine keeps and computes in (ComputeDType(declared))
  const DType declared;  // the variable's dtype as created
  const Shape shape;
  const bool trainable;
  const bool average;
  const std::string optimizer_name;
  const VarPlacement placement;
  const Aggregation aggregation;
  const bool sync_on_read;
  const size_t bytes;
  const int64_t row_elements;
  const Optimizer* const opt;

  Mutex mu;
  // Dense or sparse: claimed under `mu` by the first push that validates against an unknown kind,
  // so two first pushes of different kinds cannot both pass validation (both accumulators would
  // be created). A claim is dropped again when its push fails validation later on, unless another
  // push holds one too or a gradient of that kind was used (kind_fixed).
  GradKind kind GUARDED_BY(mu) = GradKind::kUnknown;
  int kind_claims GUARDED_BY(mu) = 0;      // validated pushes that have not yet used `kind`
  bool kind_fixed GUARDED_BY(mu) = false;  // a gradient of `kind` was accumulated or applied
  std::unique_ptr<DenseAccumulator> dense GUARDED_BY(mu);
  std::unique_ptr<SparseAccumulator> sparse GUARDED_BY(mu);
  int64_t next_take_step GUARDED_BY(mu);  // the step this variable is taken for next
  // Guarded by mu (dense) / TrainingEngine::mu_ (sparse): not expressible as an annotation.
  std::vector<Buffer> slots;
  // The fields "guarded by TrainingEngine::mu_" stay comments: an annotation here cannot name the
  // engine's mutex (clang resolves GUARDED_BY against this struct).
  std::shared_ptr<Buffer> published;    // guarded by TrainingEngine::mu_
  std::shared_ptr<Buffer> staged;       // guarded by TrainingEngine::mu_ (dense take result)
  std::shared_ptr<Buffer> spare;        // guarded by TrainingEngine::mu_
  std::shared_ptr<Buffer> shadow;       // guarded by TrainingEngine::mu_ (moving average)
  bool sparse_pending = false;          // guarded by TrainingEngine::mu_
  std::vector<int64_t> pending_rows;    // guarded by TrainingEngine::mu_
  std::vector<uint8_t> pending_values;  // guarded by TrainingEngine::mu_

  Round reduce_round GUARDED_BY(mu);
  Round update_round GUARDED_BY(mu);
  // Sync-on-read: each replica's own value (a replica that never wrote has `replica_base`).
  std::map<uint32_t, std::shared_ptr<Buffer>> replica_values;  // guarded by TrainingEngine::mu_
  std::shared_ptr<Buffer> replica_base;                        // guarded by TrainingEngine::mu_
  std::shared_ptr<Buffer> staged_update;  // guarded by TrainingEngine::mu_: published at the next commit

  int64_t acc_step() const REQUIRES(mu) { return dense ? dense->step() : sparse ? sparse->step() : next_take_step; }
};

Mutex& TrainingEngine::VariableMutex(Variable* v) RETURN_CAPABILITY(v->mu) { return v->mu; }

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
      pool_(std::max(0, config.apply_threads - 1)),
      required_(config.InitialRequiredReplicas()),
      next_lr_(config.optimizer.learning_rate),
      step_lr_(config.optimizer.learning_rate) {}

TrainingEngine::~TrainingEngine() = default;

void TrainingEngine::PushInitTokens(int count) {
  if (count > 0) tokens_.Push(global_step_.load(), count);
}

TrainingEngine::Variable* TrainingEngine::FindLocked(std::string_view name) const {
  auto it = vars_.find(name);
  return it == vars_.end() ? nullptr : it->second.get();
}

Result<VariableDesc> TrainingEngine::CreateVariable(const VariableDef& def) {
  PSD_RETURN_IF_ERROR(ValidateName(def.name));
  PSD_RETURN_IF_ERROR(ValidateShape(def.shape, def.dtype, config_.max_frame_bytes));
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
  // its slots and its average. Checked before allocating: a peer cannot exhaust the daemon's memory.
  uint64_t cost = bytes * (1 + (def.trainable ? 3 : 0) + opt->Slots().size() + (def.average ? 1 : 0));
  if (model_bytes_ + cost > config_.max_model_bytes) {
    return ResourceExhausted("variable '" + def.name + "' needs about " + std::to_string(cost) + " bytes; the " +
                             "variables already hold " + std::to_string(model_bytes_) + " of --max-model-bytes " +
                             std::to_string(config_.max_model_bytes));
  }
  model_bytes_ += cost;
  // A trainable variable created after the open step was reported joins the next step.
  const int64_t step = global_step_.load();
  const bool joins_next = def.trainable && config_.mode == Mode::kSync && prepared_ && step_takes_ > 0;
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
  return DenseAccumulator::Check(v->dtype, v->shape, g.dtype, g.shape, g.bytes);
}

Status TrainingEngine::Push(int64_t local_step, const std::vector<GradRef>& grads, std::vector<GradOutcome>* out) {
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
  return PushConverted(local_step, *use, targets, out);
}

Status TrainingEngine::PushConverted(int64_t local_step, const std::vector<GradRef>& grads,
                                 const std::vector<Variable*>& targets, std::vector<GradOutcome>* out) {
  // Validate everything before touching any accumulator: a bad push changes nothing. Each
  // variable's gradient kind is claimed while its lock is held (released on every way out).
  KindClaims claims(targets);
  for (size_t i = 0; i < grads.size(); ++i) {
    Status s = ValidateGrad(targets[i], grads[i]);
    if (!s.ok()) return Status(s.code(), "gradient for '" + targets[i]->name + "': " + s.message());
    PSD_RETURN_IF_ERROR(claims.Claim(i, grads[i].sparse() ? GradKind::kSparse : GradKind::kDense));
  }
  if (test_hook_) test_hook_("push.validated");
  out->clear();
  out->reserve(grads.size());
  if (config_.mode != Mode::kSync) {
    // Async / bounded staleness: apply now; the whole push is one global step. The step is
    // claimed first, so concurrent pushes get distinct steps (Adam's t never repeats).
    int64_t global = global_step_.fetch_add(1);
    int64_t step = global + 1;
    int64_t staleness = std::max<int64_t>(0, global - local_step);
    double lr = next_lr_.load();
    if (config_.staleness_lr == StalenessLr::kInverse) lr /= static_cast<double>(std::max<int64_t>(1, staleness));
    if (config_.staleness_lr == StalenessLr::kWorkers) lr /= static_cast<double>(std::max(1, config_.total_replicas));
    for (size_t i = 0; i < grads.size(); ++i) {
      Variable* v = targets[i];
      MutexLock vlock(&v->mu);
      claims.Use(i, v);
      ApplyNowLocked(v, grads[i], step, lr);
      out->push_back({true, global, staleness});
    }
    accepted_.fetch_add(static_cast<int64_t>(grads.size()));
    int64_t seen = max_staleness_.load();
    while (staleness > seen && !max_staleness_.compare_exchange_weak(seen, staleness)) {
    }
    if (config_.ema_decay > 0) UpdateAverages(step);
    if (on_commit_) on_commit_({step, 1, 1, false});
    return Status::Ok();
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    Variable* v = targets[i];
    const GradRef& g = grads[i];
    bool took = false, started = false;
    int count = 0;
    {
      MutexLock lock(&v->mu);
      claims.Use(i, v);
      Result<bool> accepted = false;
      if (g.sparse()) {
        if (!v->sparse)
          v->sparse = std::make_unique<SparseAccumulator>(v->dtype, v->shape, config_.reduction, v->next_take_step);
        accepted =
            v->sparse->ApplyGrad(local_step, {g.indices, g.nnz, g.dtype, g.shape, g.data, g.bytes, g.dense_shape});
      } else {
        if (!v->dense)
          v->dense = std::make_unique<DenseAccumulator>(v->dtype, v->shape, config_.reduction, v->next_take_step);
        accepted = v->dense->AddChecked(local_step, g.dtype, g.data);  // validated above
      }
      if (!accepted.ok()) return accepted.status();  // unreachable: validated above
      int64_t acc_step = v->acc_step();
      out->push_back({*accepted, acc_step, std::max<int64_t>(0, global_step_.load() - local_step)});
      if (*accepted) {
        accepted_.fetch_add(1);
        took = MaybeTakeLocked(v, false, &count);
        if (!took && on_step_started_) {
          MutexLock elock(&mu_);
          if (!step_started_) started = step_started_ = true;
        }
      } else {
        stale_.fetch_add(1);
      }
    }
    if (started) on_step_started_(global_step_.load());
    if (took) OnTaken(count);
  }
  return Status::Ok();
}

void TrainingEngine::ApplyDense(const Optimizer& opt, const ApplyArgs& args) {
  auto t0 = std::chrono::steady_clock::now();
  if (args.num_elements <= kParallelApplyElements) {
    opt.Apply(args);
    ReportApply(t0);
    return;
  }
  // Ranges touch disjoint elements of value/out/slots, so they can run in parallel.
  pool_.ParallelFor(args.num_elements, kParallelApplyElements / 4, [&](int64_t b, int64_t e) {
    size_t es = DTypeSize(args.dtype);
    std::vector<Buffer>* slots = args.slots;
    ApplyArgs part = args;
    part.num_elements = e - b;
    part.value = static_cast<const uint8_t*>(args.value) + b * es;
    part.grad = static_cast<const uint8_t*>(args.grad) + b * es;
    part.out = static_cast<uint8_t*>(args.out) + b * es;
    part.slot_offset = b;
    part.slots = slots;
    opt.Apply(part);
  });
  ReportApply(t0);
}

void TrainingEngine::ReportApply(std::chrono::steady_clock::time_point t0) {
  if (on_apply_) on_apply_(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

bool TrainingEngine::MaybeTakeLocked(Variable* v, bool force, int* count) {
  if (v->next_take_step != global_step_.load()) return false;  // already taken this step
  if (force) {
    *count = 0;
    if (v->dense) v->dense->ForceTake(count);
    if (v->sparse) v->sparse->ForceTake(count);
  } else {
    Result<bool> taken = false;
    if (v->dense) taken = v->dense->TryTakeGrad(required_.load(), count);
    if (v->sparse) taken = v->sparse->TryTakeGrad(required_.load(), count);
    if (!taken.ok() || !*taken) return false;
  }
  ++v->next_take_step;
  if (*count == 0) return true;  // forced with nothing: the value stays
  if (v->kind == GradKind::kSparse) {
    std::vector<int64_t> rows;
    std::vector<uint8_t> values;
    v->sparse->ReleaseTaken(&rows, &values);
    MutexLock lock(&mu_);
    v->pending_rows.swap(rows);
    v->pending_values.swap(values);
    v->sparse_pending = true;
    ++step_takes_begun_;
    return true;
  }
  std::shared_ptr<Buffer> value, out;
  double lr;
  {
    MutexLock lock(&mu_);
    value = v->published;
    if (v->spare && v->spare.use_count() == 1) out = std::move(v->spare);
    v->spare.reset();
    lr = step_lr_;
    ++step_takes_begun_;  // from here on this variable's slots belong to the open step
  }
  if (!out) out = std::make_shared<Buffer>(v->bytes);
  ApplyDense(*v->opt, {v->dtype, NumElements(v->shape), value->data(), v->dense->grad().data(), out->data(), &v->slots,
                       0, v->next_take_step, lr, v->dense->divisor()});
  MutexLock lock(&mu_);
  v->staged = std::move(out);
  return true;
}

void TrainingEngine::ApplySparseLocked(Variable* v, const std::vector<int64_t>& rows, const void* grad, int64_t step,
                                   double lr) {
  if (rows.empty()) return;
  auto t0 = std::chrono::steady_clock::now();
  // In place unless a pull still references the published buffer: then copy first.
  if (v->published.use_count() > 1) v->published = std::make_shared<Buffer>(*v->published);
  v->opt->ApplySparse({v->dtype, v->row_elements, v->published->data(), rows.data(), static_cast<int64_t>(rows.size()),
                       grad, &v->slots, step, lr});
  ReportApply(t0);
}

void TrainingEngine::ApplyNowLocked(Variable* v, const GradRef& g, int64_t step, double lr) {
  if (g.sparse()) {
    std::vector<int64_t> rows(g.indices, g.indices + g.nnz);
    MutexLock lock(&mu_);
    ApplySparseLocked(v, rows, g.data, step, lr);
    return;
  }
  std::shared_ptr<Buffer> value, out;
  {
    MutexLock lock(&mu_);
    value = v->published;
    if (v->spare && v->spare.use_count() == 1) out = std::move(v->spare);
    v->spare.reset();
  }
  if (!out) out = std::make_shared<Buffer>(v->bytes);
  ApplyDense(*v->opt, {v->dtype, NumElements(v->shape), value->data(), g.data, out->data(), &v->slots, 0, step, lr});
  MutexLock lock(&mu_);
  v->spare = std::move(v->published);
  v->published = std::move(out);
}

void TrainingEngine::OnTaken(int count) {
  MutexLock lock(&mu_);
  step_min_count_ = std::min(step_min_count_ == 0 ? INT_MAX : step_min_count_, count);
  step_max_count_ = std::max(step_max_count_, count);
  ++step_takes_;
  if (--pending_takes_ > 0) return;
  StepReadyLocked(lock, false);
}

void TrainingEngine::StepReadyLocked(MutexLock& lock, bool forced) {
  if (!commit_gate_) return CommitLocked(lock, forced);
  if (prepared_) return lock.UnlockFor(&mu_);
  prepared_ = true;
  step_forced_ = forced;
  int64_t step = global_step_.load();
  int min = step_min_count_ == INT_MAX ? 0 : step_min_count_, max = step_max_count_, takes = step_takes_;
  lock.UnlockFor(&mu_);
  commit_gate_(step, min, max, takes, forced);
}

void TrainingEngine::ReportIfIdle() {
  MutexLock lock(&mu_);
  if (!commit_gate_ || prepared_ || pending_takes_ != 0 || config_.mode != Mode::kSync) return;
  StepReadyLocked(lock, false);
}

Status TrainingEngine::CommitPrepared(int64_t step, bool snapshot, double next_lr) {
  // Every variable lock is held while untaken variables are looked for, so no take runs half-way
  // through: a variable created after this shard reported an idle step (the chief may commit
  // before it hears the report withdrawn) skips the step — its accumulated gradients are dropped.
  std::vector<Variable*> all;  // variables are never deleted while the engine lives
  {
    MutexLock lock(&mu_);
    for (auto& [name, v] : vars_) all.push_back(v.get());
  }
  std::vector<std::unique_lock<Mutex>> vlocks;
  for (Variable* v : all) vlocks.emplace_back(v->mu);
  MutexLock lock(&mu_);
  if (global_step_.load() != step) {
    return FailedPrecondition("asked to commit step " + std::to_string(step) + " at step " +
                              std::to_string(global_step_.load()));
  }
  for (Variable* v : all) {
    v->mu.AssertHeld();  // in vlocks
    if (!v->trainable || v->next_take_step != step) continue;
    spdlog::warn("variable '{}' was created while step {} was closing; it joins step {}", v->name, step, step + 1);
    v->next_take_step = step + 1;
    if (v->dense) v->dense = std::make_unique<DenseAccumulator>(v->dtype, v->shape, config_.reduction, step + 1);
    if (v->sparse) v->sparse = std::make_unique<SparseAccumulator>(v->dtype, v->shape, config_.reduction, step + 1);
    --pending_takes_;
  }
  vlocks.clear();
  prepared_ = false;
  if (snapshot) snapshot_requested_ = true;
  if (next_lr > 0) next_lr_.store(next_lr);
  CommitLocked(lock, step_forced_);
  return Status::Ok();
}

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

void TrainingEngine::CommitLocked(MutexLock& lock, bool forced) {
  int64_t step = global_step_.load() + 1;
  int trainable = 0;
  for (auto& [name, var] : vars_) {
    Variable* v = var.get();
    if (!v->trainable) continue;
    ++trainable;
    if (v->staged) {
      v->spare = std::move(v->published);
      v->published = std::move(v->staged);
    }
    if (v->sparse_pending) {
      ApplySparseLocked(v, v->pending_rows, v->pending_values.data(), step, step_lr_);
      v->sparse_pending = false;
      v->pending_rows.clear();
      v->pending_values.clear();
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
  if (snapshot_requested_ || (config_.checkpoint_every_steps > 0 && step % config_.checkpoint_every_steps == 0)) {
    snapshot = SnapshotLocked();  // no take for the next step can touch slots while mu_ is held
    snapshot_requested_ = false;
  }
  StepInfo info{step, step_min_count_ == INT_MAX ? 0 : step_min_count_, step_max_count_, forced};
  last_step_gradients_ = info.min_gradients;
  step_min_count_ = step_max_count_ = 0;
  step_started_ = false;
  step_lr_ = next_lr_.load();
  lock.UnlockFor(&mu_);
  if (!commit_gate_) tokens_.Push(step, config_.tokens_per_step);  // cluster: the chief's coordinator does
  if (config_.ema_decay > 0) UpdateAverages(step);
  if (snapshot && on_snapshot_) {
    // Averages are updated after the tokens (TF's order); the snapshot takes the new ones.
    MutexLock relock(&mu_);
    for (auto& vs : snapshot->variables) {
      Variable* v = FindLocked(vs.name);
      if (v && v->shadow) vs.shadow = v->shadow;
    }
    relock.Unlock();
    on_snapshot_(std::move(*snapshot));
  }
  if (on_commit_) on_commit_(info);
  // Gradients for the new step may already be waiting (pushed with a future local step, or the
  // requirement shrank); take them now rather than on the next push.
  ReevaluateAll();
  ReportIfIdle();
}

void TrainingEngine::UpdateAverages(int64_t step) {
  // TF ExponentialMovingAverage: decay = min(decay, (1 + n) / (10 + n)) with num_updates n.
  double decay = config_.ema_decay;
  if (config_.ema_num_updates) {
    float n = static_cast<float>(step);
    decay = std::min(decay, static_cast<double>((1.0f + n) / (10.0f + n)));
  }
  std::vector<std::pair<Variable*, std::shared_ptr<Buffer>>> todo;
  {
    MutexLock lock(&mu_);
    for (auto& [name, v] : vars_) {
      if (v->average) todo.emplace_back(v.get(), v->published);
    }
  }
  for (auto& [v, value] : todo) {
    std::shared_ptr<Buffer> old;
    {
      MutexLock lock(&mu_);
      old = v->shadow;
    }
    auto next = std::make_shared<Buffer>(v->bytes);
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
    MutexLock lock(&mu_);
    v->shadow = std::move(next);
  }
}

void TrainingEngine::ReevaluateAll() {
  if (config_.mode != Mode::kSync) return;
  std::vector<Variable*> all;
  {
    MutexLock lock(&mu_);
    for (auto& [name, var] : vars_) {
      if (var->trainable) all.push_back(var.get());
    }
  }
  for (Variable* v : all) {
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
  std::vector<Variable*> all;
  {
    MutexLock lock(&mu_);
    for (auto& [name, var] : vars_) {
      if (var->trainable) all.push_back(var.get());
    }
  }
  int forced = 0;
  for (Variable* v : all) {
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
      step_min_count_ = std::min(step_min_count_ == 0 ? INT_MAX : step_min_count_, count);
      step_max_count_ = std::max(step_max_count_, count);
      ++step_takes_;
      if (--pending_takes_ > 0) continue;
      StepReadyLocked(lock, true);
    }
  }
  if (forced > 0) spdlog::info("step {} forced by the step deadline", step + 1);
}

ShardSnapshot TrainingEngine::SnapshotLocked() {
  ShardSnapshot snap;
  snap.step = global_step_.load();
  snap.learning_rate = next_lr_.load();
  snap.optimizer = optimizer_->name();
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
    for (size_t k = 0; k < v->slots.size(); ++k) {
      vs.slots.emplace_back(names[k], std::make_shared<Buffer>(v->slots[k]));
    }
    snap.variables.push_back(std::move(vs));
  }
  return snap;
}

std::optional<ShardSnapshot> TrainingEngine::SnapshotIfAtBoundary() {
  if (config_.mode != Mode::kSync) {
    // Each variable's slots are updated under its own mutex: hold all of them (in name order,
    // the map's order, so two snapshots cannot deadlock) to copy every slot with its value.
    std::vector<Variable*> all;
    {
      MutexLock lock(&mu_);
      for (auto& [name, v] : vars_) all.push_back(v.get());
    }
    std::vector<std::unique_lock<Mutex>> locks;
    for (Variable* v : all) locks.emplace_back(v->mu);
    MutexLock lock(&mu_);
    return SnapshotLocked();
  }
  MutexLock lock(&mu_);
  if (step_takes_begun_ > 0) return std::nullopt;
  return SnapshotLocked();
}

void TrainingEngine::RequestSnapshot() {
  auto snap = SnapshotIfAtBoundary();
  if (!snap) {
    MutexLock lock(&mu_);
    snapshot_requested_ = true;  // taken inside the next commit
    return;
  }
  if (on_snapshot_) on_snapshot_(std::move(*snap));
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
            1.0 / static_cast<double>(std::max(1, config_.total_replicas)));
    }
  }
  MutexLock lock(&mu_);
  global_step_.store(snap.step);
  next_lr_.store(snap.learning_rate);
  step_lr_ = snap.learning_rate;
  return Status::Ok();
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

Result<PulledValue> TrainingEngine::PullRows(const std::string& name, const std::vector<int64_t>& rows, int64_t* step) {
  MutexLock lock(&mu_);
  Variable* v = FindLocked(name);
  if (v == nullptr) return NotFound("no variable named '" + name + "'");
  if (v->shape.empty()) return InvalidArgument("variable '" + name + "' is a scalar: it has no rows");
  size_t row_bytes = static_cast<size_t>(v->row_elements) * DTypeSize(v->dtype);
  if (rows.size() > config_.max_frame_bytes / std::max<size_t>(row_bytes, 1)) {
    return InvalidArgument("too many rows requested");
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || rows[i] >= v->shape[0]) {
      return InvalidArgument("row " + std::to_string(rows[i]) + " (slice " + std::to_string(i) + ") is outside [0, " +
                             std::to_string(v->shape[0]) + ")");
    }
  }
  auto buf = std::make_shared<Buffer>(rows.size() * row_bytes);
  std::shared_ptr<Buffer> value = ReadValueLocked(v);
  const uint8_t* src = static_cast<const uint8_t*>(value->data());
  uint8_t* dst = static_cast<uint8_t*>(buf->data());
  for (size_t i = 0; i < rows.size(); ++i) std::memcpy(dst + i * row_bytes, src + rows[i] * row_bytes, row_bytes);
  Shape shape = v->shape;
  shape[0] = static_cast<int64_t>(rows.size());
  *step = global_step_.load();
  return PulledValue{std::move(buf), v->dtype, std::move(shape), v->declared};
}

std::shared_ptr<Buffer> TrainingEngine::ReadValueLocked(Variable* v) {
  if (!v->sync_on_read) return v->published;
  const int n = std::max(1, config_.total_replicas);
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

Status TrainingEngine::Reduce(bool mean, int64_t local_step, const std::vector<GradRef>& values_in, ReduceDone done) {
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
  const int required = required_.load();
  for (size_t i = 0; i < values.size(); ++i) {
    Variable* v = targets[i];
    const GradRef& g = values[i];
    std::vector<Round::Waiter> ready;
    std::shared_ptr<const Buffer> result;
    int64_t round_step = 0;
    {
      MutexLock vlock(&v->mu);
      Round& r = v->reduce_round;
      if (local_step < r.step) {
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
      AddInto(v->dtype, r.sum.data(), g.data, NumElements(v->shape));
      ++r.count;
      DType dtype = v->dtype, declared = v->declared;
      Shape shape = v->shape;
      r.waiters.push_back(
          [finish_one, i, dtype, declared, shape](const Status&, int64_t step, std::shared_ptr<const Buffer> value) {
            finish_one(i, {true, step, std::move(value), dtype, declared, shape});
          });
      if (r.count < required) continue;
      auto out = std::make_shared<Buffer>(v->bytes);
      std::memcpy(out->data(), r.sum.data(), v->bytes);
      if (r.mean) Scale(v->dtype, out->data(), NumElements(v->shape), 1.0 / r.count);
      {
        MutexLock lock(&mu_);
        v->published = out;
      }
      result = out;
      round_step = r.step;
      ready.swap(r.waiters);
      r.count = 0;
      ++r.step;
    }
    for (auto& w : ready) w(Status::Ok(), round_step, result);
  }
  return Status::Ok();
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
  const int n = std::max(1, config_.total_replicas);
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
  std::vector<Round::Waiter> ready;
  Status outcome;
  int64_t round_step = 0;
  {
    MutexLock vlock(&v->mu);
    Round& r = v->update_round;
    if (a.local_step < r.step) {
      int64_t current = r.step;
      vlock.Unlock();
      done(Status::Ok(), false, current);  // stale: dropped
      return Status::Ok();
    }
    if (r.count > 0 && r.op != a.op) {
      return InvalidArgument("update: replicas use different operations on '" + v->name + "' in one round");
    }
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
    r.waiters.push_back(
        [done](const Status& s, int64_t step, std::shared_ptr<const Buffer>) { done(s, s.ok(), step); });
    if (r.count < required_.load()) return Status::Ok();
    if (v->aggregation == Aggregation::kNone && r.disagree) {
      outcome = InvalidArgument("replicas assigned different values to '" + v->name +
                                "' (aggregation NONE); nothing was changed");
    } else {
      const void* value = v->aggregation == Aggregation::kNone ? static_cast<const void*>(r.first.data())
                                                               : static_cast<const void*>(r.sum.data());
      if (v->aggregation == Aggregation::kMean) Scale(v->dtype, r.sum.data(), NumElements(v->shape), 1.0 / r.count);
      MutexLock lock(&mu_);
      ApplyUpdateLocked(v, r.op, value, 1);
    }
    round_step = r.step;
    ready.swap(r.waiters);
    r.count = 0;
    ++r.step;
  }
  for (auto& w : ready) w(outcome, round_step, nullptr);
  return Status::Ok();
}

std::vector<std::string> TrainingEngine::SlotNames(const std::string& variable) const {
  MutexLock lock(&mu_);
  Variable* v = FindLocked(variable);
  return v ? v->opt->SlotNames() : optimizer_->SlotNames();
}

Result<PulledValue> TrainingEngine::GetSlot(const std::string& variable, const std::string& slot) {
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
  auto copy = std::make_shared<Buffer>(v->bytes);
  MutexLock vlock(&v->mu);
  MutexLock lock(&mu_);  // sparse variables' slots are guarded by mu_
  std::memcpy(copy->data(), v->slots[it - names.begin()].data(), v->bytes);
  return PulledValue{std::move(copy), v->dtype, v->shape, v->declared};
}

void TrainingEngine::SetRequiredReplicas(int required) {
  required = std::max(required, 1);
  if (required_.exchange(required) != required) {
    spdlog::info("a step now needs {} fresh gradient(s) per variable", required);
    ReevaluateAll();
  }
}

Status TrainingEngine::SetLearningRate(double lr) {
  if (!(lr > 0) || !std::isfinite(lr)) return InvalidArgument("learning rate must be a positive number");
  next_lr_.store(lr);
  spdlog::info("learning rate set to {} from step {}", lr, global_step_.load() + (config_.mode == Mode::kSync ? 2 : 1));
  return Status::Ok();
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
  MutexLock lock(&mu_);
  s.variables = static_cast<int>(vars_.size());
  s.model_bytes = model_bytes_;
  return s;
}

}  // namespace psd::server
