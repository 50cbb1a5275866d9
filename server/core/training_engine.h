// TrainingEngine: the daemon-side training state and its update rules. It owns the variables, their
// accumulators, optimizer slots and moving averages, the global step and the token queue, and
// runs what TF called the chief queue runner — so no worker has to.
//
// Modes (TrainingConfig::mode):
//  - sync (TF SyncReplicasOptimizer, tf_semantics.md 3.2): every trainable variable's
//    accumulator reaches `required_replicas()` fresh gradients and is taken (its step += 1; MEAN
//    over the count actually accumulated) -> the optimizer writes the variable's next value into
//    a staging buffer -> once ALL variables are taken the staged values are published together,
//    global_step += 1, tokens_per_step tokens carrying the new step are pushed, then the moving
//    averages are updated. Pulls therefore always see every variable at one step. Soft sync
//    lowers the requirement to a fraction of the workers and/or forces the step at a deadline
//    (ForceStep) with whatever arrived.
//  - async / ssp: every push is applied on arrival (one push = one global step); the staleness
//    (global step - local step) is reported and may scale the learning rate. The ssp barrier
//    lives in SspGate; the engine's part is the same as async.
//
// Sparse (IndexedSlices) gradients: a variable takes either dense or sparse gradients (fixed by
// its first gradient). Sparse updates touch only the listed rows (lazy slots) and are applied in
// place at commit, under the engine lock, copying the value first only if a pull still holds it.
//
// Threading and locks (lock order: a Variable's `mu` before the engine's `mu_`, never the
// reverse; docs/THREADING.md has the daemon's whole picture; clang's -Wthread-safety checks the
// annotations):
//   - `Variable::mu` guards the variable's accumulators, take state and (dense variables) slots;
//     pushes to different variables accumulate in parallel, and a dense apply runs on the thread
//     of the push that completed the take (big ones split over the apply pool).
//   - `mu_` guards the variable map, published/staged/spare/shadow buffers, sparse variables'
//     slots and pending rows, the global step and the step's bookkeeping.
//   - Published values are immutable shared buffers: a pull reply holds a reference while it is
//     being written; no apply writes into a buffer a reader may hold.
#ifndef PSD_SERVER_CORE_TRAINING_ENGINE_H_
#define PSD_SERVER_CORE_TRAINING_ENGINE_H_

#include <atomic>
#include <chrono>
#include <climits>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/mutex.h"
#include "base/thread_pool.h"
#include "core/buffer.h"
#include "core/optimizer.h"
#include "core/snapshot.h"
#include "core/step_commit.h"
#include "core/token_queue.h"
#include "core/training_config.h"
#include "core/var_placement.h"
#include "psd/status.h"
#include "psd/tensor.h"

namespace psd::server {

// How replicas' assignments to a variable combine (TF VariableAggregation); for a sync-on-read
// variable, how a read combines the replicas' values.
enum class Aggregation { kNone, kSum, kMean, kOnlyFirstReplica };
enum class UpdateOp { kAssign, kAssignAdd, kAssignSub, kScale };
const char* AggregationName(Aggregation a);
// The Aggregation numbered `value` (the wire's and the checkpoint's numbering: NONE 0, SUM 1,
// MEAN 2, ONLY_FIRST_REPLICA 3); INVALID_ARGUMENT naming the valid values otherwise.
Result<Aggregation> AggregationFromNumber(int value);

// Half-precision variables (bfloat16, float16) are kept in float32 (ComputeDType, psd/half.h): the
// value, accumulators, slots and averages are float32 master copies; what a read returns is
// rounded to the variable's dtype (or to the dtype a reader asks for) where it leaves the daemon.
class DenseAccumulator;
class SparseAccumulator;

struct VariableDef {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  // nullptr: zeros; else exactly NumElements * DTypeSize(initial_dtype) bytes, converted when
  // initial_dtype is not the variable's compute dtype (ConvertibleDTypes).
  const void* initial = nullptr;
  size_t initial_bytes = 0;
  std::optional<DType> initial_dtype;  // unset: `dtype`
  // Instead of `initial`: this buffer (of the compute dtype) becomes the value without a copy (a
  // restore adopts the checkpoint's tensors). Shared copy-on-write like every published value: the
  // engine writes into it only once it holds the last reference. Must be a Buffer created non-const.
  std::shared_ptr<const Buffer> adopt;
  bool trainable = true;
  bool average = false;    // keep an exponential moving average (--ema-decay)
  std::string optimizer;   // empty: the job's optimizer; else a name with the job's hyper-parameters
  VarPlacement placement;  // cluster: the whole variable this is a part of (name empty: none); kept and checkpointed
  Aggregation aggregation = Aggregation::kNone;
  bool sync_on_read = false;  // non-trainable; each replica keeps its own value; reads combine them
};

// One reduce_to destination's outcome.
struct ReduceOutcome {
  bool accepted = false;  // false: stale (value: the destination's current value)
  int64_t step = 0;       // the round it counted for
  std::shared_ptr<const Buffer> value;
  DType dtype = DType::kFloat32;     // of `value`: the compute dtype
  DType declared = DType::kFloat32;  // the destination's own dtype
  Shape shape;
};

struct UpdateArgs {
  std::string_view name;
  UpdateOp op = UpdateOp::kAssign;
  DType dtype = DType::kFloat32;  // of the value (assign, assign_add, assign_sub)
  Shape shape;
  const void* data = nullptr;
  size_t bytes = 0;
  double factor = 1;          // scale
  bool cross_replica = true;  // one caller for all replicas: applied at once
  uint32_t replica = 0;       // replica context: whose share this is
  int64_t local_step = 0;     // replica context: staleness as for gradients
  bool at_next_step = false;  // cross-replica, sync mode: staged, published with the next commit
  int64_t sender = -1;        // the sending worker (this daemon's index; -1: not known): counted once a round
};

struct VariableDesc {
  std::string name;
  DType dtype;
  Shape shape;
  bool trainable;
  bool created;  // true if the call created it
};

// A dense gradient, or a sparse one when `indices` is set (IndexedSlices: values has shape
// [nnz, row dims...]).
struct GradRef {
  std::string_view name;
  DType dtype;
  Shape shape;
  const void* data;
  size_t bytes;
  const int64_t* indices = nullptr;
  int64_t nnz = 0;
  std::optional<Shape> dense_shape = std::nullopt;
  // A chunk of a dense gradient too big for one frame: `shape` is [n], the flattened elements
  // [chunk_offset, chunk_offset + n) of the variable's gradient (-1: a whole gradient).
  int64_t chunk_offset = -1;
  // A sparse gradient bigger than a frame: some of its rows, more of them in a later call of the
  // same push (it counts once, with its last rows).
  bool rows_more = false;
  // Sync mode, dense: set when `data` stays mapped and unchanged while this is alive and until
  // ResolveHeld() (or the step's take): the accumulator may then point at it instead of copying
  // it (DenseAccumulator, "Held gradients"). Null: the bytes are read before Push returns.
  std::shared_ptr<const void> hold = nullptr;
  // The push a chunk or a sparse gradient's rows belong to (the connection it came on; 0: not
  // known). A sparse gradient's rows (sync mode), and in deterministic mode a dense gradient's
  // chunks, are kept apart until its last part: DropUnfinishedChunks lets a cut-off one go.
  uint64_t source = 0;
  bool sparse() const { return indices != nullptr || nnz > 0; }
  bool chunk() const { return chunk_offset >= 0; }
};

struct GradOutcome {
  bool accepted;
  int64_t step;       // sync: the accumulator's step; async/ssp: the global step it was applied at
  int64_t staleness;  // global step - local step when handled (0 if ahead)
};

struct PulledValue {
  std::shared_ptr<const Buffer> value;  // immutable; hold it while the bytes are in use
  DType dtype;                          // of `value`: the variable's compute dtype (float32 for the halves)
  Shape shape;
  DType declared;                  // the variable's own dtype: what a reader gets unless it asks for another
  std::string_view variable = {};  // Pull: the variable's name (valid while the engine lives)
};

// Where ReadRows puts the rows it reads: told their layout first (it may refuse, and then nothing
// is read), then handed each row in the order asked. Runs under the engine's lock: it only copies.
class RowSink {
 public:
  virtual ~RowSink() = default;
  // `dtype`: the rows' (the variable's compute dtype); `declared`: the variable's own; `shape`:
  // [rows asked, row dims...].
  virtual Status Begin(DType dtype, DType declared, const Shape& shape) = 0;
  // Row `i` of the request: `src` holds its row elements in `dtype`.
  virtual void Row(size_t i, const uint8_t* src) = 0;
};

struct StepInfo {
  int64_t step;       // the new global step
  int min_gradients;  // fewest gradients averaged into one variable this step
  int max_gradients;  // most gradients averaged into one variable this step
  bool forced;        // committed by a step deadline (soft sync)
};

struct EngineStats {
  int64_t global_step;
  int64_t accepted;
  int64_t stale;
  int64_t tokens_queued;
  int required_replicas;
  int variables;
  int last_step_gradients;  // min gradients averaged per variable in the last committed step
  int64_t max_staleness;    // async/ssp: the largest staleness seen
  uint64_t model_bytes;     // what the variables account for against --max-model-bytes
};

// Names: 1..256 characters from [A-Za-z0-9_./:-].
Status ValidateName(std::string_view name);

class TrainingEngine {
 public:
  TrainingEngine(const TrainingConfig& config, std::unique_ptr<Optimizer> optimizer);
  ~TrainingEngine();
  TrainingEngine(const TrainingEngine&) = delete;
  TrainingEngine& operator=(const TrainingEngine&) = delete;

  // What a gradient chunk's offset and length align to (GradRef::chunk_offset), in elements.
  static constexpr int64_t kChunkElements = 512;  // DenseAccumulator::kPartElements (asserted)
  // What a variable's bookkeeping counts in --max-model-bytes besides its bytes (its entry, names,
  // accumulator and optimizer state headers): an empty variable is not free.
  static constexpr uint64_t kVariableOverheadBytes = 1024;

  // Pushes the init tokens (carrying the current global step). Call once at job start.
  void PushInitTokens(int count);

  // Create-or-get: idempotent for the same definition; a different dtype, shape, trainability,
  // averaging or optimizer for an existing name is AlreadyExists with both definitions.
  Result<VariableDesc> CreateVariable(const VariableDef& def) EXCLUDES(mu_);

  // Applies each gradient (validated all first: an invalid push changes nothing). `out` gets one
  // outcome per gradient, in order. `replica` is the pushing worker's stable name: with
  // TrainingConfig::deterministic a step's sum is formed in its order.
  //
  // A push too big for one frame arrives as several calls, each with some whole gradients and
  // chunks; all but the last have `more` set. Sync: each chunk counts for the parts of its
  // variable it covers (DenseAccumulator). Async/ssp: each call's gradients are applied as they
  // arrive, and the push is one global step, claimed by its last call.
  Status Push(int64_t local_step, const std::vector<GradRef>& grads, std::vector<GradOutcome>* out,
              std::string_view replica = {}, bool more = false) EXCLUDES(mu_);
  // The rows of sparse gradients from `source` (GradRef::source) that did not all come — its push
  // was cut off (the connection closed, or a push refused midway was followed by another) — go,
  // and in deterministic mode the slots of its dense gradients whose chunks did not. They never
  // count either way (a gradient in parts counts once all of them came, as TensorFlow's
  // all-or-nothing apply_grad); this lets their memory, and their place under the slot limit, go
  // before the take. (The default mode adds dense chunks into the sum as they arrive: a cut-off
  // gradient's parts keep it, each part averaged over what reached it.)
  void DropUnfinishedChunks(uint64_t source) EXCLUDES(mu_);
  // Copies into their sums every held gradient (GradRef::hold) that accumulators still point at,
  // waiting for adds in flight, so that no part of the engine references a hold's bytes after it.
  // A push that passed holds calls it before the worker is answered (and may reuse the bytes).
  // False: a variable's sum found no memory (the last commit's retired buffer still read); its
  // accumulator still points at them, as before the call, and a later call copies them.
  [[nodiscard]] bool ResolveHeld() EXCLUDES(mu_);

  // Snapshot of the named variables (all of them, sorted by name, if `names` is empty) at one
  // global step, returned in *step. With `averages`, the moving averages instead.
  Status Pull(const std::vector<std::string>& names, std::vector<PulledValue>* out, int64_t* step,
              bool averages = false) EXCLUDES(mu_);
  // The declared dtypes of the named variables (NotFound naming the first unknown one): checks a
  // later read's names without reading (no value is combined or referenced).
  Result<std::vector<DType>> DeclaredDTypes(const std::vector<std::string>& names) const EXCLUDES(mu_);
  // Sync: the trainable variables the open step still waits for (not taken yet, fewer fresh
  // gradients than it needs), as "'w' (1 of 2), 'b' (0 of 2)", at most `max_named` of them and a
  // count of the rest; "" when none does. For a token wait's timeout: a variable that no worker
  // sends a gradient for holds every step, as TensorFlow's would with its accumulator.
  std::string WaitingVariables(size_t max_named = 3) EXCLUDES(mu_);
  // The variable named `name`, if there is one.
  std::optional<VariableDesc> Describe(std::string_view name) const EXCLUDES(mu_);
  // An initial value of `bytes` arriving in chunks (not a variable yet) reserves them against
  // --max-model-bytes, with what the variables hold and the other reservations, until the
  // returned handle goes. RESOURCE_EXHAUSTED (naming the flag) when they do not fit.
  Result<std::shared_ptr<void>> ReserveValueBytes(const std::string& name, uint64_t bytes);
  // Gives the listed rows (any order, repeats allowed) of a variable, [n, row dims...], to `sink`,
  // all of one global step (returned): the published value is referenced under the engine's lock
  // and its rows read outside it (an apply meanwhile writes a copy), so pushes and other reads go on
  // while they are gathered. Nothing is read when a row is outside the variable or the sink refuses
  // the layout.
  Result<int64_t> ReadRows(const std::string& name, const std::vector<int64_t>& rows, RowSink& sink) EXCLUDES(mu_);

  // reduce_to / batch_reduce_to. Each value is a replica's contribution to its destination (a
  // non-trainable variable) for the destination's current round; a value tagged with an older
  // local step is dropped (stale). Once required_replicas() contributions arrived, their sum (or
  // mean) becomes the destination's value, the round advances, and every contributor waiting on
  // it is answered. All values are validated first (an invalid call changes nothing); `done`
  // runs exactly once, outside all locks, when every accepted value's round completed.
  // `replica` (the sending worker's index; -1: not known): one value per replica counts in a
  // round — its retry after a deadline waits for that round without counting again; a value for
  // a later step while its value of the open round waits is not accepted.
  using ReduceDone = std::function<void(std::vector<ReduceOutcome>)>;
  Status Reduce(bool mean, int64_t local_step, const std::vector<GradRef>& values, ReduceDone done,
                int64_t replica = -1) EXCLUDES(mu_);

  // update(variable, fn): assign / assign_add / assign_sub / scale where the variable lives.
  // Cross-replica: applied at once (on a sync-on-read variable, assign gives every replica
  // value / N for SUM, value for MEAN). Replica context: a sync-on-read variable changes this
  // replica's own value at once; otherwise the variable's aggregation decides — SUM/MEAN/NONE
  // collect required_replicas() values for the round (NONE: they must be equal) and apply the
  // combined one, ONLY_FIRST_REPLICA applies replica 0's and ignores the others. `done` runs
  // exactly once, outside all locks: (status, applied, round). With at_next_step (sync mode,
  // cross-replica) the new value is staged and published by the next commit, so every replica
  // reading after its token sees it at the same step (round = the step it lands at).
  using UpdateDone = std::function<void(const Status&, bool applied, int64_t step)>;
  Status Update(const UpdateArgs& args, UpdateDone done) EXCLUDES(mu_);
  // Lets go of every parked reduce_to/update waiter without telling it (their connections are
  // closed): at shutdown, so that what they hold (sessions, their sockets and timers) goes while
  // the I/O contexts those belong to still exist. Rounds keep their counts.
  void DropRoundWaiters() EXCLUDES(mu_);

  // Copy of an optimizer slot ("momentum", ...) of a variable.
  // With count >= 0: only elements [offset, offset + count) of the flattened slot, as a [count]
  // (INVALID_ARGUMENT when they are not inside it).
  Result<PulledValue> GetSlot(const std::string& variable, const std::string& slot, int64_t offset = 0,
                              int64_t count = -1) EXCLUDES(mu_);
  std::vector<std::string> SlotNames(const std::string& variable) const EXCLUDES(mu_);

  // How many fresh gradients a sync step waits for: replicas_to_aggregate (or the soft-sync
  // fraction of the workers), lowered as workers declare themselves finished. Re-evaluates
  // pending takes.
  void SetRequiredReplicas(int required) EXCLUDES(mu_);
  int required_replicas() const { return required_.load(); }

  // Sync: the learning rate of the steps after the current one. Async/ssp: from the next push.
  Status SetLearningRate(double lr);
  double learning_rate() const { return next_lr_.load(); }
  // The bytes of every variable's value (one version of the model), lock-free.
  uint64_t value_bytes() const { return value_bytes_.load(); }
  // Stats()'s counters alone (pushes accepted and stale, the largest staleness), lock-free.
  EngineStats Counters() const;

  // Soft sync: commits step `step` with whatever gradients arrived, if it is still open.
  void ForceStep(int64_t step) EXCLUDES(mu_);

  // Checkpoints. A snapshot is a consistent cut at a step boundary: in sync mode it is taken at
  // once if no variable has begun the open step, else inside the next commit; in async/ssp each
  // variable is copied consistently with its slots. Values and averages are shared (immutable),
  // slots are copied. The snapshot is handed to the on_snapshot callback (outside all locks).
  void RequestSnapshot() EXCLUDES(mu_);
  // The snapshot now if the state is at a step boundary (sync: no take has begun), else nullopt.
  std::optional<ShardSnapshot> SnapshotIfAtBoundary() EXCLUDES(mu_);
  // Replication: every commit also keeps a snapshot of the state it published (no copy of the
  // values), taken with TakeCommitted(). Set before serving.
  void set_keep_committed(bool keep) { keep_committed_ = keep; }
  std::optional<ShardSnapshot> TakeCommitted() EXCLUDES(mu_);
  void set_on_snapshot(std::function<void(ShardSnapshot)> cb) { on_snapshot_ = std::move(cb); }
  // Replaces the (empty) state with a checkpoint's. Call before workers connect. Takes the locks
  // in the documented order (each variable's `mu`, then `mu_`), so a request that reaches a
  // restored variable early cannot deadlock against it.
  Status Restore(const ShardSnapshot& snapshot) EXCLUDES(mu_);

  int64_t global_step() const { return global_step_.load(); }
  // Async/ssp: the count of pushes goes on from `step` if it is behind it (a cluster's new chief
  // whose own count trails the global step its predecessor counted). Sync: nothing.
  void RaiseGlobalStep(int64_t step);
  // Cluster: the epoch this engine's state belongs to (0 for a single daemon).
  uint64_t epoch() const { return epoch_; }
  void set_epoch(uint64_t epoch) { epoch_ = epoch; }
  TokenQueue& tokens() { return tokens_; }
  // The apply threads, for other big passes over memory (values written into a worker's shared
  // memory): ParallelFor and ParallelCopy take only the idle ones.
  ThreadPool& helpers() { return pool_; }
  const Optimizer& optimizer() const { return *optimizer_; }
  const TrainingConfig& config() const { return config_; }
  EngineStats Stats() const EXCLUDES(mu_);
  // How the rows of variable `name`'s last sync sparse step were dealt to its accumulator's stripes
  // (SparseAccumulator::taken_granule_rows; that step was applied stripe by stripe for coarse
  // granules, in index ranges for fine ones); 0: no such step, or no such variable.
  int64_t LastSparseGranuleRows(std::string_view name) const EXCLUDES(mu_);
  // Stats().last_step_gradients without the lock (every push reply carries it).
  int last_step_gradients() const { return last_step_gradients_.load(); }

  // How a prepared sync step commits (core/step_commit.h): at once (the default, a single
  // daemon), or, on a cluster shard, reported to `commit` and committed by CommitPrepared when the
  // cluster decides (the engine then pushes no tokens: the chief's coordinator does). Set before the
  // engine is used.
  void set_step_commit(std::unique_ptr<StepCommit> commit) { commit_ = std::move(commit); }
  // Commits prepared step `step` (publishes step + 1); `snapshot`: also hand a snapshot of the
  // new state to on_snapshot. `next_lr` (> 0) is the learning rate of the steps after it.
  // FailedPrecondition if the engine is not prepared for `step`.
  Status CommitPrepared(int64_t step, bool snapshot, double next_lr) EXCLUDES(mu_);
  // Reports the open step to the gate if this engine has nothing to take (call after Restore).
  void ReportIfIdle() EXCLUDES(mu_);
  // The placements of the variable parts this engine holds; a variable created without one
  // (a single daemon's) is reported whole on `shard`.
  std::vector<VarPlacement> Placements(int shard) const EXCLUDES(mu_);

  // Tests only: called at named points to provoke interleavings deterministically — "push.validated"
  // (a push validated its gradients and claimed their kinds, no lock held) and "restore.variable"
  // (Restore is about to set a restored variable's state; it must hold no lock there). Set before
  // the engine is used.
  void set_test_hook(std::function<void(std::string_view point)> hook) { test_hook_ = std::move(hook); }

  // Called after every committed step, outside all locks.
  void set_on_commit(std::function<void(const StepInfo&)> cb) { on_commit_ = std::move(cb); }
  // Called after every optimizer apply of a variable (or a slice of it) with its duration in
  // seconds, on the thread that applied it; set before the engine is used.
  void set_on_apply(std::function<void(double seconds)> cb) { on_apply_ = std::move(cb); }
  // Sync: called (outside all locks) when the first fresh gradient of a step arrives, so the
  // server can arm the step deadline.
  void set_on_step_started(std::function<void(int64_t step)> cb) { on_step_started_ = std::move(cb); }
  // Sync: called (maybe under a variable's lock: post, do not call back in) when a take ran out
  // of memory for its sum's buffer, or a local commit for a sparse variable's copy on write.
  // Nothing was taken (committed) and the step stays open; the owner calls RetryDeferredTakes a
  // little later (the next add of the variable tries a take again too). A callback that throws
  // std::bad_alloc armed nothing: RetryIfUnarmed, after every push and from the owner's token
  // waits that time out, tries again then.
  void set_on_take_deferred(std::function<void()> cb) { on_take_deferred_ = std::move(cb); }
  // The commit or the takes deferred since the last call, tried again (a forced step's forced
  // again, if it is still open).
  void RetryDeferredTakes() EXCLUDES(mu_);
  // RetryDeferredTakes, if something was deferred with no retry armed (see set_on_take_deferred).
  void RetryIfUnarmed() EXCLUDES(mu_) {
    if (retry_unarmed_.load(std::memory_order_relaxed) && retry_unarmed_.exchange(false)) RetryDeferredTakes();
  }

 private:
  struct Variable;
  class KindClaims;
  // A variable's own lock (`Variable::mu`), for annotations written where Variable is incomplete.
  static Mutex& VariableMutex(Variable* v);
  Variable* FindLocked(std::string_view name) const REQUIRES(mu_);
  Status ValidateGrad(Variable* v, const GradRef& g) const;
  // Adds `cost` to what the variables hold if --max-model-bytes has room (any thread), counting
  // the initial values arriving in chunks too (ReserveValueBytes) `with_reserved`; *held is what
  // the variables held before.
  bool ChargeModelBytes(uint64_t cost, uint64_t* held, bool with_reserved);
  // Sync: charges the bookkeeping of v's sparse accumulation once (SparseAccumulator::
  // BookkeepingBytes), before its first sparse gradient is used; RESOURCE_EXHAUSTED if it does
  // not fit, INVALID_ARGUMENT if v has too many rows for it (SparseAccumulator::CheckRows).
  Status ChargeSparseBookkeeping(Variable* v) EXCLUDES(mu_);
  // Push once the gradients its accumulators cannot take as they are (sparse or async/ssp halves)
  // are converted to their variable's compute dtype.
  // An async/ssp chunk, applied in place (readers of the value hold it: then it is copied first).
  void ApplyChunkLocked(Variable* v, const GradRef& g, int64_t step, double lr) REQUIRES(VariableMutex(v))
      EXCLUDES(mu_);
  Status PushConverted(int64_t local_step, const std::vector<GradRef>& grads, const std::vector<Variable*>& targets,
                       std::vector<GradOutcome>* out, std::string_view replica, bool more) EXCLUDES(mu_);
  // With v->mu held: waits until no gradient is being added into v's dense accumulator (a take,
  // or replacing the accumulator, needs every add it accepted to be complete).
  static void AwaitAddsLocked(Variable* v) REQUIRES(VariableMutex(v));
  // A sync push's gradient into v's sparse or dense accumulator (validated before): accepted, or
  // stale. The add itself runs without v's lock (released and taken again), in parallel with other
  // pushes'; if it throws, *failed holds its exception (nothing of it counted: the caller rethrows
  // it once it has done what the failed add leaves to do).
  Result<bool> AddSparseLocked(Variable* v, const GradRef& g, int64_t local_step, uint64_t reserved,
                               std::exception_ptr* failed) REQUIRES(VariableMutex(v)) EXCLUDES(mu_);
  // Sync, at validation: charges to --max-model-bytes, as reserved, what g's rows add to those v
  // keeps for a gradient sent in several frames (0: none; RESOURCE_EXHAUSTED when it does not
  // fit). AddSparseLocked uses the reservation; ReleaseStaging gives back one not used.
  Result<uint64_t> ReserveStaging(Variable* v, const GradRef& g, int64_t local_step) EXCLUDES(VariableMutex(v));
  void ReleaseStaging(Variable* v, uint64_t reserved) EXCLUDES(VariableMutex(v));
  Result<bool> AddDenseLocked(Variable* v, const GradRef& g, int64_t local_step, std::string_view replica,
                              std::exception_ptr* failed) REQUIRES(VariableMutex(v)) EXCLUDES(mu_);
  // Makes v's charge for the rows of sparse gradients sent in parts what they hold now (kept, in
  // an add, or reserved for one).
  void SettleStagingLocked(Variable* v) REQUIRES(VariableMutex(v));
  // Gradients of v being added now (dense and sparse), whose step cannot be taken until they end.
  static int AddsInFlightLocked(Variable* v) REQUIRES(VariableMutex(v));
  // The variables (the trainable ones only, with `trainable_only`), in name order. Variables are
  // never deleted while the engine lives, so the pointers stay valid without mu_.
  std::vector<Variable*> Variables(bool trainable_only = false) EXCLUDES(mu_);
  // With v->mu held: takes (and applies, for dense) if the step is ready. Returns true if it took.
  bool MaybeTakeLocked(Variable* v, bool force, int* count) REQUIRES(VariableMutex(v)) EXCLUDES(mu_);
  // A take of `v` that ran out of memory (`forced`: a forced one): logged, remembered for
  // RetryDeferredTakes, the owner told. Returns false (not taken).
  bool DeferTakeLocked(Variable* v, bool forced) REQUIRES(VariableMutex(v));
  // After a take (no variable lock held): records it; commits if it was the last.
  void OnTaken(int count) EXCLUDES(mu_);
  // Publishes the step, unlocks (`lock` holds mu_), then pushes tokens and runs the callbacks.
  void CommitLocked(MutexLock& lock, bool forced) RELEASE(mu_);
  // Every trainable variable is taken: commits, or (cluster) reports to the gate. Unlocks.
  void StepReadyLocked(MutexLock& lock, bool forced) RELEASE(mu_);
  // What a commit allocates, before it changes anything: a sparse variable's copy on write and
  // list of rows (PrepareSparseApplyLocked). False, logged, when memory ran out (nothing changed).
  bool PrepareCommitLocked() REQUIRES(mu_);
  void PrepareSparseApplyLocked(Variable* v) REQUIRES(mu_);
  // A local commit that found no memory: remembered for RetryDeferredTakes, the owner told. Unlocks.
  void DeferCommitLocked(MutexLock& lock, bool forced) RELEASE(mu_);
  // Marks a retry due (take_deferred_ at least `level`) and tells the owner (on_take_deferred_).
  void ArmRetry(int level) EXCLUDES(mu_);
  // SnapshotLocked at a commit of `step`; out of memory, none (the step commits all the same),
  // a checkpoint's asked for again at the next commit.
  std::optional<ShardSnapshot> TrySnapshotLocked(int64_t step, bool checkpoint) REQUIRES(mu_);
  void ReevaluateAll() EXCLUDES(mu_);
  // Async/ssp: applies one gradient now (v->mu held).
  void ApplyNowLocked(Variable* v, const GradRef& g, int64_t step, double lr) REQUIRES(VariableMutex(v)) EXCLUDES(mu_);
  // Async/ssp: an update of v's published value in place (v->mu held, as by every writer of v).
  // Under mu_: the value is copied on write (CopyOnWriteLocked) and `prepare` lists what the write
  // changes (replication's difference) and returns how to write it; then `write` runs with mu_
  // released and v->writing_in_place set, so that pushes and pulls of other variables go on
  // meanwhile, and whoever would read v's value waits for the write (AwaitInPlaceWriteLocked).
  template <typename Prepare, typename Write>
  void WriteInPlace(Variable* v, Prepare prepare, Write write) REQUIRES(VariableMutex(v)) EXCLUDES(mu_);
  // Before v's value is read (a reference taken under mu_): waits, mu_ released, while an in-place
  // write of it is under way (WriteInPlace), so no reader sees half of one.
  void AwaitInPlaceWriteLocked(Variable* v) REQUIRES(mu_);
  // Before an in-place update: the published value, if a reader or a kept copy holds it, is copied
  // into a buffer of its own (the spare one, when nothing holds that).
  void CopyOnWriteLocked(Variable* v) REQUIRES(mu_);
  // Lists the rows of v a sparse update of `n` rows of `grad` writes (its value's and its slots'),
  // in increasing order or in `order`'s (SparseApplyArgs::order), and returns the update's
  // arguments for Optimizer::UpdateSparse (mu_ held). The caller copies on write first and
  // reports the apply.
  SparseApplyArgs ListSparseRowsLocked(Variable* v, const int64_t* rows, size_t n, const void* grad,
                                       const uint32_t* order, int64_t step, double lr) REQUIRES(mu_);
  // The commit's apply of v's taken sparse rows (pending_sparse, then cleared): listed in
  // increasing order across the stripes (SparseAccumulator::ForEachRowInOrder), the stripes
  // updated in parallel on the apply threads.
  void ApplyPendingSparseLocked(Variable* v, int64_t step, double lr) REQUIRES(mu_);
  // Moving averages: one commit's (or async push's) at a time, in the order their values were
  // taken, each from the shadow the one before wrote (TF's chief queue runner ran them in turn).
  // The values are the published ones when the turn is taken (under mu_, at the commit).
  struct AveragesTurn {
    uint64_t ticket = 0;
    int64_t step = 0;
    std::vector<std::pair<Variable*, std::shared_ptr<const Buffer>>> values;
  };
  AveragesTurn TakeAveragesTurnLocked(int64_t step) REQUIRES(mu_);
  // Waits for the turn, updates, and returns the new shadows (a commit's snapshot takes these, not
  // a later commit's).
  std::vector<std::pair<Variable*, std::shared_ptr<Buffer>>> UpdateAverages(AveragesTurn turn)
      EXCLUDES(mu_, averages_mu_);
  void ApplyDense(const Optimizer& opt, const ApplyArgs& args);
  // ApplyDense of a sync take whose gradient `acc` still partly points at held gradients
  // (DenseAccumulator::TakenGrad): args.grad is the taken sum's bytes.
  void ApplyTaken(const Optimizer& opt, const ApplyArgs& args, const DenseAccumulator& acc);
  // A variable's dense accumulator from round `step` on (deterministic: its slots limited to twice
  // the larger of -N and -R, and 8 more).
  std::unique_ptr<DenseAccumulator> NewDenseAccumulator(const Variable& v, int64_t step) const;
  // ... and its sparse one (as many adders as I/O threads: SparseAccumulator::SetAdders).
  std::unique_ptr<SparseAccumulator> NewSparseAccumulator(const Variable& v, int64_t step) const;
  // Offers the dense accumulator the retired value (spare) as its round's sum, if it has none and
  // no pull reads the spare any more (see Push).
  void OfferSpareLocked(Variable* v) REQUIRES(VariableMutex(v)) EXCLUDES(mu_);
  void ReportApply(std::chrono::steady_clock::time_point t0);
  ShardSnapshot SnapshotLocked() REQUIRES(mu_);  // every variable's slots consistent with its value
  // mu_ held: the value a read sees (a sync-on-read variable's combined replica values).
  std::shared_ptr<Buffer> ReadValueLocked(Variable* v) REQUIRES(mu_);
  // mu_ held: applies `op` with `value` (host bytes of v's dtype and shape) to v's value.
  void ApplyUpdateLocked(Variable* v, UpdateOp op, const void* value, double factor) REQUIRES(mu_);
  // Collective rounds (reduce_to, update) whose count reached `required`: completed (the value
  // published, the round's step moved past its contributors'), their waiters returned to be told
  // outside the locks. Under v->mu.
  struct RoundDone;
  RoundDone CompleteReduceRound(Variable* v) REQUIRES(VariableMutex(v)) EXCLUDES(mu_);
  RoundDone CompleteUpdateRound(Variable* v) REQUIRES(VariableMutex(v)) EXCLUDES(mu_);
  // Every collective round the lowered required count completes now (SetRequiredReplicas).
  void CompleteLoweredRounds() EXCLUDES(mu_);

  const TrainingConfig config_;
  std::unique_ptr<Optimizer> optimizer_;
  std::map<std::string, std::unique_ptr<Optimizer>> per_variable_optimizers_ GUARDED_BY(mu_);
  ThreadPool pool_;  // the apply threads (--apply-threads)
  // Adds of one variable in flight at once up to which each also takes idle apply threads.
  static constexpr int kHelpedAdds = 2;
  // A sync step's sparse rows are updated in index ranges of at least this many rows per apply
  // thread (256 KiB of float32 rows of 64).
  static constexpr int64_t kSparseApplyGrainRows = 1024;
  TokenQueue tokens_;
  std::function<void(const StepInfo&)> on_commit_;
  std::function<void(double)> on_apply_;
  std::function<void(int64_t)> on_step_started_;
  std::function<void()> on_take_deferred_;
  // A take that ran out of memory (DeferTakeLocked): 0 none, 1 to try again, 2 a forced one; and
  // the step of the last one logged (one warning per step).
  std::atomic<int> take_deferred_{0};
  std::atomic<int64_t> take_deferred_forced_step_{-1};  // the step a forced take was deferred in
  std::atomic<int64_t> take_deferred_logged_{-1};
  std::atomic<bool> retry_unarmed_{false};  // ArmRetry told no owner (none set, or its callback threw)
  std::function<void(ShardSnapshot)> on_snapshot_;
  bool keep_committed_ = false;
  std::optional<ShardSnapshot> committed_ GUARDED_BY(mu_);  // the last commit's state (keep_committed_)
  std::unique_ptr<StepCommit> commit_ = std::make_unique<LocalStepCommit>();
  std::function<void(std::string_view)> test_hook_;

  uint64_t epoch_ = 0;                   // set before the engine is shared
  std::atomic<int64_t> global_step_{0};  // sync: written under mu_; async/ssp: claimed per push
  std::atomic<int> required_;
  std::atomic<int64_t> accepted_{0};
  std::atomic<int64_t> stale_{0};
  std::atomic<int64_t> max_staleness_{0};
  std::atomic<double> next_lr_;
  std::atomic<int> last_step_gradients_{0};

  mutable Mutex mu_;
  std::map<std::string, std::unique_ptr<Variable>, std::less<>> vars_ GUARDED_BY(mu_);
  int pending_takes_ GUARDED_BY(mu_) = 0;  // trainable variables not yet taken this step
  // Read by Stats() without mu_, which it must never wait for: a large variable is allocated and
  // filled under it (a second or more), and a status request waiting there holds the I/O thread
  // that also reads this shard's peer links. Written under mu_ (the check against
  // --max-model-bytes and the add are one step there).
  std::atomic<uint64_t> model_bytes_{0};  // the memory the variables account for
  std::atomic<uint64_t> value_bytes_{0};  // of their values alone
  // ReserveValueBytes's (shared with the handles, which may outlive the engine).
  const std::shared_ptr<std::atomic<uint64_t>> reserved_value_bytes_ = std::make_shared<std::atomic<uint64_t>>(0);
  std::atomic<int> variable_count_{0};            // vars_.size()
  int step_min_count_ GUARDED_BY(mu_) = INT_MAX;  // INT_MAX: no take yet this step
  int step_max_count_ GUARDED_BY(mu_) = 0;
  bool step_started_ GUARDED_BY(mu_) = false;  // a fresh gradient arrived for the open step
  double step_lr_ GUARDED_BY(mu_);             // learning rate of the open step
  int step_takes_begun_ GUARDED_BY(mu_) = 0;   // variables whose take for the open step has begun
  int step_takes_ GUARDED_BY(mu_) = 0;         // variables taken for the open step
  bool snapshot_requested_ GUARDED_BY(mu_) = false;
  // Sync commits whose moving averages are being updated (outside mu_): RequestSnapshot waits until
  // they are, or it would hold step N's values with step N-1's averages.
  int averages_pending_ GUARDED_BY(mu_) = 0;
  uint64_t averages_issued_ GUARDED_BY(mu_) = 0;  // AveragesTurn tickets handed out
  // Taken by UpdateAverages only (before mu_): whose turn it is.
  Mutex averages_mu_;
  CondVar averages_turn_;
  CondVar in_place_done_;  // with mu_: an in-place write (WriteInPlace) ended
  uint64_t averages_served_ GUARDED_BY(averages_mu_) = 0;
  bool prepared_ GUARDED_BY(mu_) = false;                // cluster: reported the open step to the gate
  bool step_forced_ GUARDED_BY(mu_) = false;             // the open step was forced by a deadline
  int commit_deferred_ GUARDED_BY(mu_) = 0;              // DeferCommitLocked: 0 none, 1 to commit, 2 a forced one
  int64_t commit_deferred_logged_ GUARDED_BY(mu_) = -1;  // the step its warning was logged for (one a step)
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_TRAINING_ENGINE_H_
