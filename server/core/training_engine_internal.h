// The training engine's internals, shared by its source files (training_engine.cc: the variable
// store, pushes and reads; engine_step.cc: takes, applies, commits, moving averages;
// engine_snapshot.cc: snapshots, restore, placements; engine_collectives.cc: reduce_to, update,
// sync-on-read). Not for use outside core/training_engine*.cc.
#ifndef PSD_SERVER_CORE_TRAINING_ENGINE_INTERNAL_H_
#define PSD_SERVER_CORE_TRAINING_ENGINE_INTERNAL_H_

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <deque>

#include "core/accumulator.h"
#include "core/sparse_accumulator.h"
#include "core/training_engine.h"
#include "psd/half.h"

namespace psd::server {
namespace engine_internal {

constexpr int64_t kParallelApplyElements = 1 << 20;  // split applies of variables bigger than this
// Elements per block of TrainingEngine::ApplyTaken: whole accumulator parts, 16 KiB of float32, so
// that a block's gradient formed from held ones is still in cache when the optimizer reads it.
constexpr int64_t kApplyBlockElements = 8 * DenseAccumulator::kPartElements;

enum class GradKind { kUnknown, kDense, kSparse };

// How many steps behind `global` a gradient computed at `local_step` is (0 when not behind),
// saturated: a worker's local_step is any int64 (TF's is too), and global - INT64_MIN overflows.
inline int64_t StalenessOf(int64_t global, int64_t local_step) {
  if (local_step >= global) return 0;
  uint64_t behind = static_cast<uint64_t>(global) - static_cast<uint64_t>(local_step);  // wraps, never UB
  return behind > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(behind);
}

inline const char* KindName(GradKind k) { return k == GradKind::kSparse ? "sparse" : "dense"; }

inline void Scale(DType dtype, void* data, int64_t n, double factor) {
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

}  // namespace engine_internal

// One round of replica contributions to a variable (reduce_to, or an aggregated assignment):
// the sum (and, for NONE, the first value and whether any differed) of the values tagged with
// this round's step or later. Guarded by the variable's `mu`.
struct Round {
  using Waiter = std::function<void(const Status&, int64_t step, std::shared_ptr<const Buffer> value)>;
  int64_t step = 0;     // values tagged with an older step are stale
  int64_t newest = -1;  // the newest step a value of this round was tagged with
  int count = 0;
  // Who contributed (known senders) and with which step: one value per sender counts in a round.
  std::vector<std::pair<int64_t, int64_t>> senders;
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
  CondVar adds_done;  // with mu: signalled when the dense accumulator's last in-flight add ends
  // Dense or sparse: claimed under `mu` by the first push that validates against an unknown kind,
  // so two first pushes of different kinds cannot both pass validation (both accumulators would
  // be created). A claim is dropped again when its push fails validation later on, unless another
  // push holds one too or a gradient of that kind was used (kind_fixed).
  engine_internal::GradKind kind GUARDED_BY(mu) = engine_internal::GradKind::kUnknown;
  int kind_claims GUARDED_BY(mu) = 0;      // validated pushes that have not yet used `kind`
  bool kind_fixed GUARDED_BY(mu) = false;  // a gradient of `kind` was accumulated or applied
  // ChargeSparseBookkeeping's bytes are counted (set once, under mu; read first without it).
  std::atomic<bool> sparse_charged{false};
  std::unique_ptr<DenseAccumulator> dense GUARDED_BY(mu);
  std::unique_ptr<SparseAccumulator> sparse GUARDED_BY(mu);
  // Charged to --max-model-bytes for the rows of sparse gradients sent in parts (kept until their
  // last part, then added), what of them is being added now, and what validated pushes reserved.
  uint64_t staging_charged GUARDED_BY(mu) = 0;
  uint64_t staging_adding GUARDED_BY(mu) = 0;
  uint64_t staging_reserved GUARDED_BY(mu) = 0;  // by pushes validated and not yet added
  int64_t next_take_step GUARDED_BY(mu);         // the step this variable is taken for next
  // The round's sum did not take `spare` (a pull still read it): offered again at its next add.
  bool spare_offered GUARDED_BY(mu) = false;
  // Guarded by mu (dense) / TrainingEngine::mu_ (sparse): not expressible as an annotation.
  std::vector<Buffer> slots;
  // The fields "guarded by TrainingEngine::mu_" stay comments: an annotation here cannot name the
  // engine's mutex (clang resolves GUARDED_BY against this struct).
  std::shared_ptr<Buffer> published;  // guarded by TrainingEngine::mu_
  // Async/ssp: an in-place write of `published` (a sparse gradient's rows, a dense chunk) is under
  // way outside mu_ (TrainingEngine::WriteInPlace); guarded by TrainingEngine::mu_.
  bool writing_in_place = false;
  std::shared_ptr<Buffer> staged;          // guarded by TrainingEngine::mu_ (dense take result)
  std::shared_ptr<Buffer> spare;           // guarded by TrainingEngine::mu_
  std::shared_ptr<Buffer> older;           // guarded by TrainingEngine::mu_ (the value before spare)
  std::shared_ptr<Buffer> shadow;          // guarded by TrainingEngine::mu_ (moving average)
  bool sparse_pending = false;             // guarded by TrainingEngine::mu_
  std::vector<SparseRows> pending_sparse;  // guarded by TrainingEngine::mu_ (the take's rows, per stripe)
  int64_t pending_granule_rows = 0;        // guarded by TrainingEngine::mu_ (how the stripes were dealt)
  // The commit's list of them in index order, and where each one's sum is (kept: cleared, not
  // freed). Guarded by TrainingEngine::mu_.
  std::vector<int64_t> apply_rows;
  std::vector<const void*> apply_grads;
  // With replicas (keep_committed): each slot's last three snapshot copies, oldest first (room for
  // three reserved: a snapshot changes them once it may not fail). Guarded by TrainingEngine::mu_.
  std::vector<std::vector<std::shared_ptr<Buffer>>> slot_copies;

  Round reduce_round GUARDED_BY(mu);
  Round update_round GUARDED_BY(mu);
  // Sync-on-read: each replica's own value (a replica that never wrote has `replica_base`).
  std::map<uint32_t, std::shared_ptr<Buffer>> replica_values;  // guarded by TrainingEngine::mu_
  std::shared_ptr<Buffer> replica_base;                        // guarded by TrainingEngine::mu_
  std::shared_ptr<Buffer> staged_update;  // guarded by TrainingEngine::mu_: published at the next commit

  int64_t acc_step() const REQUIRES(mu) { return dense ? dense->step() : sparse ? sparse->step() : next_take_step; }
};

// Inline so that every source file of the engine sees which lock it names (clang's analysis).
inline Mutex& TrainingEngine::VariableMutex(Variable* v) RETURN_CAPABILITY(v->mu) { return v->mu; }

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_TRAINING_ENGINE_INTERNAL_H_
