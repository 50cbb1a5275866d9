// DenseAccumulator: TensorFlow's ConditionalAccumulator semantics for one variable
// (shared/reference/tf_semantics.md section 1), without the blocking: the TrainingEngine decides
// when to take.
//
//   apply: stale iff local_step < step(); stale gradients are dropped (counter unchanged).
//          Accepted ones are added into the running sum; counter += 1.
//   take:  needs counter >= num_required (> 0); step += 1; MEAN divides by the counter actually
//          accumulated (may exceed num_required), SUM returns the raw sum; counter = 0.
//   set_global_step: overwrite (a lower value is allowed, as TF, and reported), keeps pending
//          gradients.
// Deliberate deviation from TF: shape/dtype/size are validated even for stale gradients, so a
// malformed push always gets an error.
//
// Concurrent adds: a gradient is added in three parts. BeginAdd (the staleness check; the add is
// then in flight) and EndAdd (counter += 1) run under the owner's lock, as does everything else;
// Add runs without it, and the Adds of one step run in parallel: the sum is split into stripes of
// kStripeElements, each with its own lock, and each Add walks them from its own starting stripe,
// so two workers' gradients for one variable are added at once instead of one after the other.
// A take needs in_flight() == 0 (the owner waits for it): a gradient that passed BeginAdd for a
// step is in that step's sum. Each stripe's sum is formed in arrival order, like the whole sum
// before; with two gradients per step that is exact (a + b == b + a), with more it is within
// float rounding of the sequential sum.
//
// Chunks: a gradient bigger than one frame arrives in chunks (AddChunk: the elements [offset,
// offset + n), aligned to parts of kPartElements). Each part counts its own gradients, as if
// every part were its own accumulator (TF's partitioned variables): a part's sum is complete when
// its count reaches num_required, and the take needs every part complete. A chunk that never comes
// (its worker died mid-push) leaves the parts it covers waiting for another worker's, never a
// part summed from a fraction of a gradient. With MEAN each part is divided by its own count.
//
// Held gradients: an add may come with a `hold` (a reference that keeps its bytes mapped, and the
// caller's promise that they stay as they are until ResolveHeld() or the take). Then a part's
// first gradient of a round is not copied into the sum: the part points at it, and the second
// gradient is added to it in one pass (sum = first + second: the same floats as the copy and the
// add, one pass over the memory less). A take, and ResolveHeld(), copy what is still only pointed
// at. The engine passes a hold for gradients a worker wrote into its shared-memory segment, which
// it leaves alone until its push is answered (service/session_push.cc resolves before that).
// A later held gradient is pointed at too, as the part's pending one: it is added when the part's
// next gradient comes (sum = first + pending, or sum += pending, then the new one is pending or
// added), so a held last gradient of the round is never added by an add. A take with `keep_held` leaves
// the pointers in place and the engine's apply forms each block's gradient from them as it reads
// it (TakenGrad: first + pending, or sum + pending, in a cache-sized block): the sum's buffer is
// then written once, by the optimizer, instead of by the last add and again by the optimizer.
// Each element's sum is the same floats as adding in arrival order.
//
// Deterministic reduction (TrainingConfig::deterministic): Add copies each gradient into a slot of
// its replica (the worker's stable name) instead, and the take sums the slots in replica order, so
// the same gradients always give bit-identical sums whatever order they arrived in. It holds one
// model-sized slot per gradient of a step (the cost of a fixed order; slots are reused across steps).
// A gradient in chunks fills one slot of its replica and push (AddChunk's `source`) and counts as
// one whole gradient once every chunk came: one whose chunks did not all come never counts and is
// left out of the take's sum, as TensorFlow's all-or-nothing apply_grad (no per-part counts here).
//
// Thread-safety: Add may run concurrently with other Adds (between their BeginAdd and EndAdd);
// every other call is serialized by the owner (TrainingEngine: the variable's mutex).
#ifndef PSD_SERVER_CORE_ACCUMULATOR_H_
#define PSD_SERVER_CORE_ACCUMULATOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/mutex.h"
#include "base/thread_pool.h"
#include "core/buffer.h"
#include "core/training_config.h"
#include "psd/status.h"
#include "psd/tensor.h"

namespace psd::server {

// "dtype mismatch: accumulator is float32, gradient is float64", shared by both accumulators.
Status CheckGradientDType(DType want, DType got);

// dst[i] += src[i] over n elements of dtype (float32 or float64), dst and src not overlapping.
void AddInto(DType dtype, void* dst, const void* src, int64_t n);

class DenseAccumulator {
 public:
  // Elements per stripe of the concurrent add (1 MiB of float32): big enough that taking a stripe's
  // lock costs nothing next to its add, small enough that concurrent adders rarely meet.
  static constexpr int64_t kStripeElements = 1 << 18;
  // Elements per part: what chunks align to and what counts its gradients (2 KiB of float32, so
  // that even a 4 KiB --max-frame-bytes carries a chunk). A stripe holds whole parts.
  static constexpr int64_t kPartElements = 512;
  static_assert(kStripeElements % kPartElements == 0);

  DenseAccumulator(DType dtype, Shape shape, Reduction reduction, int64_t initial_step, bool deterministic = false);

  // Checks that a gradient matches this accumulator's dtype, shape and byte size. Errors use
  // TF's wording ("Shape mismatch: expected [3,2], got [2,2]").
  Status Validate(DType dtype, const Shape& shape, size_t bytes) const {
    return Check(dtype_, shape_, dtype, shape, bytes);
  }
  // The same check for an accumulator of `want_dtype`/`want_shape` that need not exist (the
  // engine validates a whole push before any accumulator is touched).
  static Status Check(DType want_dtype, const Shape& want_shape, DType dtype, const Shape& shape, size_t bytes);

  // TF apply_grad. Returns true when accepted, false when stale (dropped).
  Result<bool> ApplyGrad(int64_t local_step, DType dtype, const Shape& shape, const void* data, size_t bytes);
  // ApplyGrad for a gradient that already passed Check against this accumulator's dtype and
  // shape (the engine validates a whole push first): no second validation on the hot path.
  // BeginAdd, Add and EndAdd in one.
  bool AddChecked(int64_t local_step, DType dtype, const void* data, std::string_view replica = {});

  // The concurrent add (see above). BeginAdd returns false for a stale gradient (dropped: nothing
  // else to call), or in deterministic mode for one past LimitSlots; otherwise the add is in flight
  // and the caller must call Add, then EndAdd.
  bool BeginAdd(int64_t local_step);
  // Deterministic mode: at most `max_slots` gradients (a model-sized slot each) wait for a take;
  // more are dropped like stale ones. Honest workers send one per step each; a worker sending
  // gradients for future steps over and over while a step is open would grow the daemon. 0: no limit.
  void LimitSlots(int max_slots);
  // Adds a validated gradient (Check passed); thread-safe against other Adds. `replica` orders
  // the sum in deterministic mode (ignored otherwise). `helpers`: a pool whose idle threads take
  // some of the stripes (null: the caller adds them all); each stripe's sum is the same either way.
  // `hold`: see "Held gradients" (null: the bytes are read before Add returns).
  void Add(DType dtype, const void* data, std::string_view replica, ThreadPool* helpers = nullptr,
           const std::shared_ptr<const void>& hold = nullptr);
  void EndAdd();
  // An Add or AddChunk that failed (out of memory) ends without counting: the take no longer waits
  // for it. It failed before it changed anything (the sum's buffer is taken first, PrepareAdd; a
  // deterministic slot before it is filed), so the sum is as if it never came.
  void CancelAdd() { --in_flight_; }
  // A chunk of a gradient: elements [offset, offset + n) of the flattened tensor, `data` holding
  // just them (CheckChunk passed). Between BeginAdd and EndAddChunk, like Add.
  // `source` (deterministic mode): the push it is part of; a gradient's chunks fill one slot of
  // their replica and source.
  void AddChunk(DType dtype, const void* data, int64_t offset, int64_t n, std::string_view replica,
                ThreadPool* helpers = nullptr, const std::shared_ptr<const void>& hold = nullptr, uint64_t source = 0);
  // Deterministic mode: the slots of `source` whose chunks did not all come are freed for reuse
  // (they never counted: a gradient in chunks counts once its slot is complete, and a take leaves
  // incomplete slots out). Under the owner's lock, with no add of `source` in flight.
  void DropUnfinished(uint64_t source);
  // Copies every part that still points at a held gradient into the sum and lets the holds go:
  // after it the accumulator references nothing of its callers'. Needs in_flight() == 0 (an add
  // still running may yet point at its bytes), like a take, which does it first. Throws
  // std::bad_alloc when the sum's buffer cannot be had, before it changes anything (the sum is
  // taken at the first part that needs it, and every later one finds it).
  void ResolveHeld();
  bool holds() const;  // some part points at a held gradient
  // Counts the chunk for the parts it covers.
  void EndAddChunk(int64_t offset, int64_t n);
  // Checks a chunk for an accumulator of `want_dtype`/`want_shape`: a flat [n] of a gradient's
  // dtype, starting at a part boundary, ending at one or at the end, inside the tensor.
  static Status CheckChunk(DType want_dtype, const Shape& want_shape, DType dtype, const Shape& shape, size_t bytes,
                           int64_t offset);
  int in_flight() const { return in_flight_; }

  // TF take_grad without the wait. Errors with "Argument num_required must be positive, but was
  // <n>" for num_required <= 0. Returns false (nothing changes) while counter < num_required.
  // On success *count is the number of gradients taken and the result is grad() / divisor()
  // (MEAN: the count; SUM: 1), valid until the next ApplyGrad. The division is left to the
  // consumer so the optimizer can fuse it into its own pass over the memory (TF divides in
  // place first: the same arithmetic, one pass less here).
  // `keep_held`: the parts that still point at held gradients stay so (taken_holds()): the
  // caller reads the taken gradient through TakenGrad, then calls DropTakenHolds.
  Result<bool> TryTakeGrad(int num_required, int* count, bool keep_held = false);
  // After a keep_held take: whether some part of the taken gradient is still only pointed at.
  bool taken_holds() const { return taken_holds_; }
  // After a keep_held take, before DropTakenHolds: the taken gradient of elements [begin, *run_end),
  // where *run_end <= end ends the run of parts kept alike from `begin` (a part boundary). It is
  // read in place (in `sum`, the taken sum's bytes, or in a held gradient) or formed in `scratch`
  // (room for end - begin elements of the dtype). Parts of the run are read-only meanwhile; runs
  // may be read on several threads at once.
  const void* TakenGrad(const void* sum, int64_t begin, int64_t end, void* scratch, int64_t* run_end) const;
  // Lets the taken round's held gradients go (after the apply that read them).
  void DropTakenHolds();
  // After a take: the element ranges [begin, end) of parts no gradient reached (a forced take of a
  // round with chunks), merged and in order; empty when every part got one. Their sum is zero, and
  // the engine leaves them as they are — value and optimizer slots — as it leaves a variable that
  // got no gradient at all (momentum or Adam would otherwise still move them).
  const std::vector<std::pair<int64_t, int64_t>>& unsent() const { return unsent_; }

  // Takes whatever is there (a soft-sync step deadline passed); *count may be 0 (then grad()
  // is meaningless). step += 1. Needs in_flight() == 0 (TryTakeGrad waits for it too).
  void ForceTake(int* count);

  // TF set_global_step. Returns true when the new step is lower than the current one (TF only
  // warns about that and still lowers it).
  bool SetGlobalStep(int64_t new_step);
  bool deterministic() const { return deterministic_; }

  // Gradients in the sum (a chunked one counts once every part has it: the fewest over the parts).
  int num_accumulated() const { return counter_ + (chunked_ ? MinPartCount() : 0); }
  int64_t step() const { return step_; }
  const Buffer& grad() const { return *sum_at_.load(); }  // after a take with a count > 0, until ReleaseSum
  // The take's sum, handed over (the engine applies the optimizer into it in place and publishes
  // it); the next round's sum is the buffer ProvideSum offered, or a new one taken when the round
  // first writes into its sum — not before: a round whose first gradient is held has no need of
  // one until its second, by when the buffer the engine offers is usually free. A sum buffer is
  // in use only while a round accumulates, so a variable needs two model-sized buffers (its value
  // and this), not three.
  std::shared_ptr<Buffer> ReleaseSum() EXCLUDES(sum_mu_);
  bool has_sum() const { return sum_at_.load() != nullptr; }
  // Offers a buffer of the sum's size for the round (ignored if it has one, or for another size);
  // thread-safe against Adds.
  void ProvideSum(std::shared_ptr<Buffer> buffer) EXCLUDES(sum_mu_);
  double divisor() const { return divisor_; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }

 private:
  const DType dtype_;
  const Shape shape_;
  const Reduction reduction_;
  const int64_t num_elements_;
  int64_t step_;
  int counter_ = 0;     // whole gradients; chunks are counted per part in part_counts_
  int in_flight_ = 0;   // BeginAdd without EndAdd yet
  uint64_t round_ = 1;  // bumped by every take: a part last filled in an older round starts over
  double divisor_ = 1;  // of the last take
  const size_t bytes_;  // of the sum, and of each deterministic slot
  // The sum's buffer: null between ReleaseSum and the round's first write or ProvideSum. sum_at_
  // is its address, read without the lock by the adds (set once a round, under it).
  mutable Mutex sum_mu_;
  std::shared_ptr<Buffer> sum_ GUARDED_BY(sum_mu_);
  std::atomic<Buffer*> sum_at_{nullptr};
  // The sum's bytes, taking a new buffer first if the round has none yet.
  char* SumData() EXCLUDES(sum_mu_);

  struct Stripe {
    Mutex mu;  // guards the stripe's elements of sum_ and its parts' part_round_, held_ and held_last_
    std::atomic<uint32_t> held_adds{0};  // held adds begun this round (PrepareAdd; reset by the take)
  };
  // Adds (or, first in the round, copies) elements [begin, end) from `src` (element `begin`) into the sum.
  void AddRange(DType dtype, const void* src, int64_t begin, int64_t end, bool first);
  // AddRange for elements [begin, end) of stripe i (whole parts) under its lock, `data` holding
  // element `base` first. `held`: the bytes are held (a part's first gradient is pointed at).
  void AddToStripe(int64_t i, DType dtype, const void* data, int64_t base, int64_t begin, int64_t end, bool held);
  // AddToStripe over stripes s0 + (start + k) % count for k in [0, count), some on `helpers`
  // when [begin, end) spans two stripes' worth of elements or more.
  void AddToStripes(int64_t s0, int64_t count, int64_t start, DType dtype, const void* data, int64_t base,
                    int64_t begin, int64_t end, ThreadPool* helpers, bool held);
  // Before an add (default mode) of stripes [s0, s1) changes anything: whether it may point at
  // its bytes (`dtype`, `hold`; the hold is then kept), and the sum's buffer taken if the add may
  // write to it. The buffer is the add's one allocation, so an add that runs out of memory throws
  // here and leaves the sum as it was. A held add writes only a part where two other adds came
  // first (one left its gradient pending there); the first two held adds of each of its stripes
  // in a round go without the buffer (at least one of those two others is not one of them, and
  // took it here first), so a round of two same-host workers' held gradients leaves it to a spare
  // offered before the take, as when the buffer was taken at the first write.
  bool PrepareAdd(DType dtype, const std::shared_ptr<const void>& hold, int64_t s0, int64_t s1);
  // Copies the held parts of stripe i into the sum (its lock held).
  void ResolveStripe(int64_t i);
  // The state of the part holding element e in `round` (accumulator.cc), and where the run of parts
  // alike that starts at `at` ends (at most `end`).
  int PartState(int64_t e, uint64_t round) const;
  int64_t RunEnd(int64_t at, int64_t end, uint64_t round) const;
  // Points the parts of elements [begin, end) in `at` (held_ or held_last_) at src's (null: at none).
  void SetHeld(const char** at, int64_t begin, int64_t end, const char* src) const;
  // ForceTake, keeping held parts when `keep_held` (TryTakeGrad).
  void Take(int* count, bool keep_held);
  int MinPartCount() const { return min_part_; }
  // The take of a round with chunks: parts whose counts differ are divided (MEAN) by their own
  // count in place and divisor_ becomes 1; a part nobody sent (a forced take) is zeroed.
  void SettleParts(int* count);
  std::vector<std::pair<int64_t, int64_t>> unsent_;  // of the last take (unsent())
  bool chunked_ = false;                             // a chunk arrived this round
  std::vector<int> part_counts_;                     // per part: chunks counted this round (on top of counter_)
  int min_part_ = 0;                                 // the fewest of part_counts_
  int64_t at_min_ = 0;                               // parts with min_part_ chunks
  int64_t num_stripes_ = 0;
  std::unique_ptr<Stripe[]> stripes_;
  int64_t num_parts_ = 0;
  // Per part: the round whose gradients the part's sum holds (the first add of a round copies).
  // Each entry is guarded by the mutex of the stripe that holds the part.
  std::unique_ptr<uint64_t[]> part_round_;
  std::atomic<uint64_t> next_start_{0};  // spreads concurrent adders' starting stripes
  // Held gradients: per part, the held bytes of its first gradient this round (null: the sum
  // holds it), guarded like part_round_; not allocated in deterministic mode (no holds there).
  // The holds that keep them mapped.
  std::unique_ptr<const char*[]> held_;
  // Per part, likewise: the held bytes of its latest gradient, not added yet (to the held first
  // gradient or to the sum). Allocated with held_.
  std::unique_ptr<const char*[]> held_last_;
  bool taken_holds_ = false;  // the last take kept held parts (TakenGrad reads them)
  uint64_t taken_round_ = 0;  // the round the last take took
  mutable Mutex holds_mu_;
  std::vector<std::shared_ptr<const void>> holds_ GUARDED_BY(holds_mu_);

  // Deterministic mode: a step's gradients, one slot each, summed in replica order at the take.
  struct Slot {
    std::string replica;
    uint64_t arrival;                // orders one replica's own gradients (in the order it sent them)
    std::unique_ptr<Buffer> values;  // in the accumulator's dtype
    std::vector<bool> parts;         // chunks: the parts filled so far (empty: a whole gradient)
    uint64_t source = 0;             // chunks: the push they came in (AddChunk)
    int64_t filled = 0;              // chunks: parts filled so far
    bool complete = false;           // chunks: every part filled (counted as a whole gradient)
  };
  // The slot a chunk of `replica` from `source` covering parts [p0, p1) goes to: their oldest slot
  // with none of them filled yet, or a new one. Marks them filled; returns its values.
  Buffer* ChunkSlot(std::string_view replica, uint64_t source, int64_t p0, int64_t p1);
  std::unique_ptr<Buffer> TakeFreeSlot() REQUIRES(slots_mu_);
  void SumSlots();  // the take: sum_ = the slots in (replica, arrival) order; slots freed
  const bool deterministic_;
  Mutex slots_mu_;
  std::vector<Slot> slots_ GUARDED_BY(slots_mu_);
  std::vector<std::unique_ptr<Buffer>> free_slots_ GUARDED_BY(slots_mu_);
  uint64_t arrivals_ GUARDED_BY(slots_mu_) = 0;
  int completed_ GUARDED_BY(slots_mu_) = 0;  // chunk slots completed, not yet counted by EndAddChunk
  int max_slots_ GUARDED_BY(slots_mu_) = 0;  // LimitSlots (0: none)
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_ACCUMULATOR_H_
