// SparseAccumulator: TensorFlow's SparseConditionalAccumulator semantics for one variable's
// IndexedSlices gradients (shared/reference/tf_semantics.md section 2), without the blocking.
//
//   A gradient is (indices, values[nnz, row...], optional dense_shape). Same staleness rule,
//   counter and take as the dense accumulator. Rows with equal indices are summed and counted;
//   MEAN divides each row by its own count (the number of gradients that contained it).
//   Checks run in TF's order with TF's messages; psd adds two that protect the variable's
//   memory: indices must be strictly increasing (sorted, unique) and non-negative. Clients that
//   hold unsorted or duplicated indices coalesce them first (psclient does).
//
//   Cost: TF merges each gradient's sorted rows with all rows held (R gradients of K rows: R^2 K
//   / 2 row copies a step). psd finds a row's place through a hash table of the rows held, so a
//   gradient costs its own K rows, whatever was added before, and a take copies no row. The take's
//   rows stay where they arrived; beside them it gives their order by index (each gradient's new
//   rows are an increasing run: the runs merged), in which the engine updates them and lists them
//   for copies. What it holds beside the rows' values follows the rows sent, at most
//   BookkeepingBytes.
//
// Concurrent adds, as DenseAccumulator's: the variable's rows are split into stripes (at most
// kMaxStripes, one per kMinStripeRows rows), each with its own lock, row table, rows and sums. A
// stripe holds every num_stripes()-th granule of consecutive rows. Granules are kCoarseGranuleRows
// rows at first (a stripe's rows near each other: their sums are read in runs). When a step's rows
// crowd one stripe so that it alone holds more than an adder's share of them (1 / SetAdders, the
// adders counted at most num_stripes() / 4: the Adds of that stripe, one at a time, then bound
// the step however many threads add) they become kFineGranuleRows rows from the next step on, and
// coarse again once a step's rows would hold at most half that share in any coarse stripe. So the
// hot rows of a skewed workload (the low ids of a vocabulary sorted by frequency: under Zipf 1 a
// third of a batch's 4096 distinct rows of 1 M are among the first 4096) spread over all the
// stripes instead of filling the first one, whose lock every Add would wait for; with few adders
// (or even rows) granules stay coarse.
//
// A gradient is added in three parts: BeginAdd (the staleness check, and the rows of a gradient
// sent in parts kept until its last part) and EndAdd (counter += 1) under the owner's lock; Add
// without it, concurrently with other workers' Adds, one stripe at a time (each Add starts at
// another stripe). An Add reserves what every stripe it touches may need before it adds to any,
// so one that fails (out of memory) leaves no row of its gradient summed: a gradient is added whole
// or not at all, as TF's apply_grad. A take needs in_flight() == 0 (the owner waits for it). Each
// row is summed in the order gradients reached its stripe: with one Add at a time (or two
// gradients of the row: a + b == b + a) that is TF's merge order, bit-identical to its sums; with
// more at once, within float rounding of them.
//
//   The take's result is per stripe (taken(): rows, averaged sums, their order by index); each
//   stripe's `order` is increasing, the stripes' rows interleave granule by granule (granules of
//   taken_granule_rows(); ForEachRowInOrder lists them all in order).
//
// Thread-safety: Add may run concurrently with other Adds (between their BeginAdd and EndAdd);
// every other call is serialized by the owner (TrainingEngine: the variable's mutex).
#ifndef PSD_SERVER_CORE_SPARSE_ACCUMULATOR_H_
#define PSD_SERVER_CORE_SPARSE_ACCUMULATOR_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "base/mutex.h"
#include "core/training_config.h"
#include "psd/status.h"
#include "psd/tensor.h"

namespace psd::server {

struct SparseGradRef {
  const int64_t* indices;
  int64_t nnz;
  DType dtype;
  Shape values_shape;  // [nnz, row dims...]
  const void* values;
  size_t values_bytes;
  std::optional<Shape> dense_shape;  // TF has_known_shape
};

// Rows of a sparse step: each row's index and its values, in the order they came, and `order`,
// their positions by increasing index.
struct SparseRows {
  std::vector<int64_t> indices;
  std::vector<uint8_t> values;
  std::vector<uint32_t> order;
};

class SparseAccumulator {
 public:
  // Stripes: at most this many, one per kMinStripeRows rows (a variable of fewer rows than that
  // has one), dealt granules of kCoarseGranuleRows or kFineGranuleRows consecutive rows (powers
  // of two).
  static constexpr int64_t kMaxStripes = 64;
  static constexpr int64_t kMinStripeRows = 4096;
  static constexpr int64_t kCoarseGranuleRows = 4096;
  static constexpr int64_t kFineGranuleRows = 64;

  // `declared` is the variable's shape: its first dimension bounds the indices. `stripe_rows`:
  // kMinStripeRows (0) or fewer (tests). `granule_rows`: 0, granules that follow the rows as
  // above; else always of that many rows (rounded down to a power of two; tests).
  SparseAccumulator(DType dtype, Shape declared, Reduction reduction, int64_t initial_step, int64_t stripe_rows = 0,
                    int64_t granule_rows = 0);
  ~SparseAccumulator();

  // The most rows a variable accumulating sparse gradients may have on a shard (a held row's
  // place is 32 bits); CheckRows says so.
  static constexpr int64_t kMaxRows = int64_t{UINT32_MAX} - 1;
  static Status CheckRows(const Shape& declared);
  // What accumulating a variable of `rows` rows may hold beyond two value-sized buffers of rows
  // (the sums accumulating, and a take's until its commit applies them: the variable's own charge
  // counts those), were every row sent: the hash tables (each at most half full: under 16 bytes a
  // row), the held rows' indices and counts (12), the take's order and its merge scratch (8),
  // where each gradient's rows begin (4), the engine's copy of the taken rows' indices and order
  // (12), and the commit's list of them in index order with where each one's sum is (16). Each
  // grows with the rows sent, never beyond the variable's rows.
  static uint64_t BookkeepingBytes(int64_t rows) { return static_cast<uint64_t>(rows) * 68; }

  Status Validate(const SparseGradRef& g) const { return Check(dtype_, declared_, g, counter_ > 0); }
  // The same checks for a variable of `dtype`/`declared` whose accumulator need not exist;
  // `accumulating` only words one message as TF does.
  static Status Check(DType dtype, const Shape& declared, const SparseGradRef& g, bool accumulating);

  // A gradient to add (BeginAdd's): the caller's, or the whole one its parts made.
  struct PendingAdd {
    bool add = false;  // Add(*this), then EndAdd (or CancelAdd), follow
    SparseGradRef grad{};
    std::vector<int64_t> whole_indices;  // a gradient sent in parts: its rows, whole
    std::vector<uint8_t> whole_values;
  };
  // For a gradient validated already (Validate). Returns true when accepted, false when stale
  // (dropped). `counts` false: some of a gradient's rows, more of them to come from `source` (a
  // gradient bigger than a frame; each part's rows follow the last's). They are kept apart until
  // its last rows come (counts true, the same source): then the whole gradient is added and
  // counted at once, or dropped whole if a take made it stale meanwhile, as TensorFlow's
  // apply_grad is all or nothing. A take never sees a gradient's first rows without its last.
  // When *add says so, the add is in flight: Add it, then EndAdd (CancelAdd if Add threw).
  Result<bool> BeginAdd(int64_t local_step, const SparseGradRef& g, bool counts, uint64_t source, PendingAdd* add);
  // Adds the gradient into the stripes its rows fall in; may run concurrently with other Adds.
  // All or nothing: if it throws (out of memory), no row of it is in the sums.
  void Add(const PendingAdd& add);
  void EndAdd() {
    ++counter_;
    --in_flight_;
  }
  void CancelAdd() { --in_flight_; }
  int in_flight() const { return in_flight_; }
  // Validate, BeginAdd, Add and EndAdd, for a caller with no concurrent adds (one thread).
  Result<bool> ApplyGrad(int64_t local_step, const SparseGradRef& g, bool counts = true, uint64_t source = 0);
  // The rows kept for `source`'s unfinished gradient go (its push was cut off).
  void DropUnfinished(uint64_t source) { unfinished_.erase(source); }
  // What the rows kept for gradients sent in parts hold (their buffers' capacity, in bytes), and
  // how much more BeginAdd(local_step, g, counts, source) would make them hold: 0 unless it keeps
  // rows (the owner charges it to --max-model-bytes first). HeldBytes: what `add` holds of a
  // gradient sent in parts, whole (until the caller lets it go after its Add).
  uint64_t StagedBytes() const;
  uint64_t StagingGrowth(int64_t local_step, const SparseGradRef& g, bool counts, uint64_t source) const;
  static uint64_t HeldBytes(const PendingAdd& add) {
    return add.whole_indices.capacity() * sizeof(int64_t) + add.whole_values.capacity();
  }
  // As DenseAccumulator::TryTakeGrad. On success the averaged rows are in taken(). Needs
  // in_flight() == 0.
  Result<bool> TryTakeGrad(int num_required, int* count);
  // Takes whatever is there (a step deadline passed); *count may be 0. Needs in_flight() == 0.
  void ForceTake(int* count);
  bool SetGlobalStep(int64_t new_step);

  int num_accumulated() const { return counter_; }
  int64_t step() const { return step_; }
  int64_t num_stripes() const { return num_stripes_; }
  // How many threads may Add at once (the daemon's I/O threads; 2 until told): what a stripe's
  // share of a step's rows is weighed against (AdaptGranules).
  void SetAdders(int adders) { adders_ = std::max(adders, 1); }
  // The stripe that holds `row` now (every num_stripes()-th granule of rows from the stripe's
  // first); and in `stripes` stripes dealt `granule_rows` rows at a time.
  int64_t StripeOf(int64_t row) const { return (row >> granule_shift_) % num_stripes_; }
  static int64_t StripeOf(int64_t row, int64_t stripes, int64_t granule_rows) {
    return (row >> GranuleShift(granule_rows)) % stripes;
  }
  // The rows of a granule now (the next step's), and in the last take's result.
  int64_t granule_rows() const { return int64_t{1} << granule_shift_; }
  int64_t taken_granule_rows() const { return int64_t{1} << taken_granule_shift_; }
  // The result of the last take (until the next take or ReleaseTaken), one per stripe: its rows in
  // arrival order, each row's averaged sum, and their order by index. Dense shape of the result:
  // [declared dim0, row dims...].
  const std::vector<SparseRows>& taken() const { return taken_; }
  // Calls f(row, stripe, position) for every row of `taken` (a take's result: one SparseRows per
  // stripe, as taken() gives, of an accumulator dealt `granule_rows` rows at a time) in increasing
  // order; the row is taken[stripe].indices[position]. It merges the stripes granule by granule: a
  // round of taken.size() granules holds one of each stripe's, in stripe order. Costs the rows plus
  // one look at each stripe per round that holds any. Static: the layout is all it needs (the
  // engine calls it on rows it took out, without the variable's lock).
  template <typename F>
  static void ForEachRowInOrder(const std::vector<SparseRows>& taken, F&& f, int64_t granule_rows) {
    const int shift = GranuleShift(granule_rows);
    const auto stripes = static_cast<int64_t>(taken.size());
    std::array<size_t, kMaxStripes> at{};
    for (;;) {
      // The first round any stripe has rows left in.
      int64_t round = -1;
      for (int64_t s = 0; s < stripes; ++s) {
        const SparseRows& t = taken[static_cast<size_t>(s)];
        if (at[s] == t.order.size()) continue;
        const int64_t r = (t.indices[t.order[at[s]]] >> shift) / stripes;
        if (round < 0 || r < round) round = r;
      }
      if (round < 0) return;
      for (int64_t s = 0; s < stripes; ++s) {
        const SparseRows& t = taken[static_cast<size_t>(s)];
        // This round's granule of stripe s ends where the next one begins.
        const int64_t end = (round * stripes + s + 1) << shift;
        for (; at[s] < t.order.size(); ++at[s]) {
          const uint32_t position = t.order[at[s]];
          const int64_t row = t.indices[position];
          if (row >= end) break;
          f(row, s, position);
        }
      }
    }
  }
  // log2 of the power of two at most `granule_rows` (at least 1).
  static int GranuleShift(int64_t granule_rows) {
    int shift = 0;
    while ((int64_t{2} << shift) <= granule_rows) ++shift;
    return shift;
  }
  // Swaps the last take's result out for the buffers given (the take before's, once applied),
  // which hold the next step's rows: a step allocates nothing once they have grown.
  void ReleaseTaken(std::vector<SparseRows>* given);

 private:
  struct Stripe;
  // Rows [begin, end) of a gradient: consecutive ones of one granule (so of one stripe).
  using Slice = std::pair<uint32_t, uint32_t>;
  // Merges g's rows in `slices` (all in stripe s, in increasing order; `rows` in all) into it;
  // s->mu held, room reserved.
  template <typename T>
  void MergeInto(Stripe* s, const SparseGradRef& g, const Slice* slices, size_t count, size_t rows);
  // Makes room in s for `rows` more rows of one more gradient beside those held and promised
  // (s->mu held); may throw (out of memory), changing nothing but capacities.
  void ReserveIn(Stripe* s, size_t rows);
  // The stripe's rows become its take's result (in taken_[i]), averaged for MEAN; its hash table
  // forgets them. Allocates nothing (ReserveIn reserved what it needs).
  template <typename T>
  void TakeStripe(int64_t i);
  void FinishTake(int* count);
  // Granules of 1 << shift rows from now on: each stripe's rows_in follows. No rows held.
  void DealGranules(int shift);
  // After a take: fine granules if its rows crowded one stripe (more than an adder's share),
  // coarse ones again if they would have spread over those (at most half an adder's share).
  void AdaptGranules();

  const DType dtype_;
  const Shape declared_;
  const Reduction reduction_;
  const int64_t row_elements_;
  const uint64_t hash_multiplier_;  // random, odd: which rows share slots cannot be chosen by a peer
  int granule_shift_;               // log2 of the rows of a granule
  int taken_granule_shift_;         // ... in taken_
  bool adapt_granules_;             // granule_shift_ follows the rows (AdaptGranules)
  int adders_ = 2;                  // SetAdders
  int64_t num_stripes_;
  std::unique_ptr<Stripe[]> stripes_;
  std::atomic<uint64_t> next_start_{0};  // spreads concurrent Adds' first stripes
  int64_t step_;
  int counter_ = 0;
  int in_flight_ = 0;
  std::vector<SparseRows> taken_;        // one per stripe
  std::vector<SparseRows> spare_taken_;  // as many, for a caller that has none yet (ReleaseTaken)
  // The rows so far of gradients sent in several parts, by source, until their last part.
  struct Unfinished {
    std::vector<int64_t> indices;
    std::vector<uint8_t> values;
  };
  std::map<uint64_t, Unfinished> unfinished_;
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_SPARSE_ACCUMULATOR_H_
