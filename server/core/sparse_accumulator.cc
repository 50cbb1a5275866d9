#include "core/sparse_accumulator.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <exception>
#include <random>

#include "base/prefetch.h"
#include "base/scope_exit.h"
#include "core/accumulator.h"

namespace psd::server {

Status SparseAccumulator::Check(DType dtype, const Shape& declared, const SparseGradRef& g, bool accumulating) {
  auto S = [](int64_t v) { return std::to_string(v); };
  PSD_RETURN_IF_ERROR(CheckGradientDType(dtype, g.dtype));
  if (declared.empty()) return InvalidArgument("a scalar variable cannot take sparse gradients");
  if (g.values_shape.empty()) return InvalidArgument("Values cannot be 0-dimensional.");
  if (g.values_shape[0] != g.nnz) {
    return InvalidArgument("Expected " + S(g.nnz) + " non-empty input values, got " + S(g.values_shape[0]));
  }
  if (g.dense_shape) {
    const Shape& ds = *g.dense_shape;
    if (declared.size() > ds.size()) {
      return InvalidArgument("Shape mismatch: expected shape rank at least " + S(declared.size()) + ", got " +
                             S(ds.size()));
    }
    for (size_t i = 0; i < declared.size(); ++i) {
      if (ds[i] != declared[i]) {
        return InvalidArgument("Shape mismatch: expected shape dim " + S(i) + " to be " + S(declared[i]) + ", got " +
                               S(ds[i]));
      }
    }
  }
  for (int64_t i = 0; i < g.nnz; ++i) {
    int64_t idx = g.indices[i];
    if (idx >= declared[0]) {
      return InvalidArgument("Shape mismatch: index of slice " + S(i) + " exceeded limits of shape; index is " +
                             S(idx) + " exceeded " + S(declared[0]));
    }
    if (idx < 0) return InvalidArgument("index of slice " + S(i) + " is negative: " + S(idx));
    if (i > 0 && idx <= g.indices[i - 1]) {
      return InvalidArgument("indices must be strictly increasing (sorted, unique): slice " + S(i) + " has " + S(idx) +
                             " after " + S(g.indices[i - 1]));
    }
  }
  // The variable's row shape is fully known, so values must be [nnz, declared[1:]...]. TF's
  // texts: against the accumulated gradient's rank once gradients are accumulating, else "at
  // least" the declared rank (a higher rank, which TF would let through until the apply, gets
  // the exact rank psd needs).
  if (g.values_shape.size() != declared.size()) {
    const bool at_least = !accumulating && g.values_shape.size() < declared.size();
    return InvalidArgument(std::string("Shape mismatch: expected values rank ") + (at_least ? "at least " : "") +
                           S(declared.size()) + ", got " + S(g.values_shape.size()));
  }
  for (size_t i = 1; i < declared.size(); ++i) {
    if (g.values_shape[i] != declared[i]) {
      return InvalidArgument("Shape mismatch: expected values dim " + S(i) + " to be " + S(declared[i]) + ", got " +
                             S(g.values_shape[i]));
    }
  }
  const int64_t row_elements = NumElements(Shape(declared.begin() + 1, declared.end()));
  size_t want = static_cast<size_t>(g.nnz * row_elements) * DTypeSize(dtype);
  if (g.values_bytes != want) {
    return InvalidArgument("values data has " + std::to_string(g.values_bytes) + " bytes, expected " +
                           std::to_string(want));
  }
  return Status::Ok();
}

Status SparseAccumulator::CheckRows(const Shape& declared) {
  if (!declared.empty() && declared[0] > kMaxRows) {
    return InvalidArgument("a variable accumulating sparse gradients may have at most " + std::to_string(kMaxRows) +
                           " rows on a shard; this one has " + std::to_string(declared[0]) +
                           " here: give it fewer rows of more elements each, or spread it over more shards");
  }
  return Status::Ok();
}

namespace {

// A random odd multiplier per accumulator: which rows share a slot of its table cannot be chosen
// by a peer (rows picked to collide would make every lookup walk them all).
uint64_t RandomOddMultiplier() {
  uint64_t bits = 0;
  try {
    std::random_device device;
    bits = static_cast<uint64_t>(device()) << 32 | device();
  } catch (const std::exception&) {  // no entropy source: the clock, mixed (still unknown to peers)
    bits = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9E3779B97F4A7C15ull;
  }
  return bits | 1;
}

// The capacity that holds `n` elements, grown from `capacity` (at most `most`, all it can ever
// hold): geometrically, so appends do not move what is held again and again.
size_t Grown(size_t capacity, size_t n, size_t most) {
  n = std::min(n, most);
  return capacity < n ? std::min(std::max(n, capacity * 2), most) : capacity;
}

template <typename V>
void Reserve(V& v, size_t n, size_t most) {
  v.reserve(Grown(v.capacity(), n, most));
}

// An empty buffer's storage goes when it could hold more than `most` elements.
template <typename V>
void FreeIfOver(V& v, size_t most) {
  if (v.capacity() > most) V().swap(v);
}

}  // namespace

// One stripe's rows: every num_stripes_-th granule of rows from its own (DealGranules).
struct SparseAccumulator::Stripe {
  Mutex mu;
  int64_t rows_in = 0;  // the stripe's rows in the layout of the moment (set while no Add is in flight)
  // The rows held, in arrival order: index, sum, and how many gradients contained it; and where
  // each gradient's new rows begin (an increasing run each).
  std::vector<int64_t> rows GUARDED_BY(mu);
  std::vector<uint8_t> sums GUARDED_BY(mu);
  std::vector<int32_t> counts GUARDED_BY(mu);
  std::vector<uint32_t> run_starts GUARDED_BY(mu);
  // Where each held row is: an open-addressing table (linear probing) of positions in rows plus
  // one (0: an empty slot), at most half full: its size follows the rows held, not the stripe's.
  // Kept from step to step.
  std::vector<uint32_t> place GUARDED_BY(mu);
  int place_shift GUARDED_BY(mu) = 64;  // 64 - log2(place.size())
  // The next take's order and its merge scratch.
  std::vector<uint32_t> order GUARDED_BY(mu);
  std::vector<uint32_t> merged GUARDED_BY(mu);
  // Rows and runs reserved for Adds that have not merged them yet.
  size_t promised GUARDED_BY(mu) = 0;
  size_t promised_runs GUARDED_BY(mu) = 0;

  // The slot of `row` in place: its position + 1, or the empty slot where it goes.
  uint32_t* Place(int64_t row, uint64_t multiplier) REQUIRES(mu) {
    // Multiplicative hashing: the top bits of row x an odd multiplier.
    size_t i = static_cast<size_t>((static_cast<uint64_t>(row) * multiplier) >> place_shift);
    const size_t mask = place.size() - 1;
    for (;; i = (i + 1) & mask) {
      uint32_t& at = place[i];
      if (at == 0 || rows[at - 1] == row) return &at;
    }
  }
  // Makes room in place for `held` rows (at most the stripe's).
  void ReservePlaces(size_t held, uint64_t multiplier) REQUIRES(mu) {
    held = std::min(held, static_cast<size_t>(rows_in));
    if (held * 2 <= place.size()) return;
    size_t slots = 64;
    int shift = 64 - 6;
    while (slots < held * 2) {
      slots *= 2;
      --shift;
    }
    std::vector<uint32_t> fresh(slots, 0);  // allocated before anything changes (a failure leaves all as it was)
    place.swap(fresh);
    place_shift = shift;
    for (size_t i = 0; i < rows.size(); ++i) *Place(rows[i], multiplier) = static_cast<uint32_t>(i + 1);
  }
  // Empties the hash table (frees it when it is much bigger than the rows it held: a burst of
  // rows once; the next rows make one of their size).
  void ForgetPlaces() REQUIRES(mu) {
    if (place.size() > 8 * std::max<size_t>(rows.size(), 64)) {
      std::vector<uint32_t>().swap(place);
      place_shift = 64;
    } else {
      std::fill(place.begin(), place.end(), 0);
    }
  }
  // Forgets the rows held (their places too).
  void ClearRows() REQUIRES(mu) {
    ForgetPlaces();
    rows.clear();
    sums.clear();
    counts.clear();
    run_starts.clear();
  }
  // order: the positions of rows by increasing index. Each gradient's new rows are one
  // increasing run: merged pairwise, log2(gradients) passes over positions (none for one).
  // Allocates nothing (ReserveIn reserved order, merged and run_starts).
  void SortOrder() REQUIRES(mu) {
    const size_t n = rows.size();
    order.resize(n);
    for (size_t i = 0; i < n; ++i) order[i] = static_cast<uint32_t>(i);
    std::vector<uint32_t>& runs = run_starts;
    if (runs.size() <= 1) {
      runs.clear();
      return;
    }
    runs.push_back(static_cast<uint32_t>(n));
    const int64_t* const row_of = rows.data();
    const auto by_row = [row_of](uint32_t a, uint32_t b) { return row_of[a] < row_of[b]; };
    while (runs.size() > 2) {
      merged.resize(n);
      size_t kept = 0;
      for (size_t r = 0; r + 1 < runs.size(); r += 2) {
        const uint32_t begin = runs[r], mid = runs[r + 1];
        const uint32_t end = r + 2 < runs.size() ? runs[r + 2] : mid;
        std::merge(order.begin() + begin, order.begin() + mid, order.begin() + mid, order.begin() + end,
                   merged.begin() + begin, by_row);
        runs[kept++] = begin;
      }
      runs[kept++] = static_cast<uint32_t>(n);
      runs.resize(kept);
      order.swap(merged);
    }
    runs.clear();
  }
};

SparseAccumulator::SparseAccumulator(DType dtype, Shape declared, Reduction reduction, int64_t initial_step,
                                     int64_t stripe_rows, int64_t granule_rows)
    : dtype_(dtype),
      declared_(std::move(declared)),
      reduction_(reduction),
      row_elements_(declared_.empty() ? 1 : NumElements(Shape(declared_.begin() + 1, declared_.end()))),
      hash_multiplier_(RandomOddMultiplier()),
      step_(initial_step) {
  const int64_t rows = declared_.empty() ? 1 : std::max<int64_t>(declared_[0], 1);
  if (stripe_rows <= 0) stripe_rows = kMinStripeRows;
  adapt_granules_ = granule_rows <= 0;
  // No more stripes than the finest granules give.
  const int64_t finest = int64_t{1} << GranuleShift(adapt_granules_ ? kFineGranuleRows : granule_rows);
  num_stripes_ = std::clamp<int64_t>((rows + stripe_rows - 1) / stripe_rows, 1, kMaxStripes);
  num_stripes_ = std::min(num_stripes_, (rows + finest - 1) / finest);
  stripes_ = std::make_unique<Stripe[]>(static_cast<size_t>(num_stripes_));
  DealGranules(GranuleShift(adapt_granules_ ? kCoarseGranuleRows : granule_rows));
  taken_granule_shift_ = granule_shift_;
  taken_.resize(static_cast<size_t>(num_stripes_));
  spare_taken_.resize(static_cast<size_t>(num_stripes_));
}

void SparseAccumulator::DealGranules(int shift) {
  granule_shift_ = shift;
  // Granule g goes to stripe g mod num_stripes_; the last granule may be short (and a stripe may
  // have none).
  const int64_t rows = declared_.empty() ? 1 : std::max<int64_t>(declared_[0], 1);
  const int64_t granule = int64_t{1} << shift;
  const int64_t granules = (rows + granule - 1) / granule;
  const size_t row_bytes = static_cast<size_t>(row_elements_) * DTypeSize(dtype_);
  for (int64_t i = 0; i < num_stripes_; ++i) {
    Stripe* s = &stripes_[i];
    const int64_t mine = i < granules ? (granules - i + num_stripes_ - 1) / num_stripes_ : 0;
    MutexLock lock(&s->mu);  // no Add in flight (a take, or the constructor): for the analysis
    s->rows_in = mine * granule - ((granules - 1) % num_stripes_ == i ? granules * granule - rows : 0);
    // No rows held: buffers grown for more rows than the stripe now has go, so the stripes hold
    // what their rows may need, as BookkeepingBytes counts (ReleaseTaken hands back no bigger).
    const auto most = static_cast<size_t>(s->rows_in);
    FreeIfOver(s->rows, most);
    FreeIfOver(s->counts, most);
    FreeIfOver(s->sums, most * row_bytes);
    FreeIfOver(s->order, most);
    FreeIfOver(s->merged, most);
    FreeIfOver(s->run_starts, most + 1);
    if (s->place.size() > 4 * std::max<size_t>(most, 32)) {  // ReservePlaces makes at most that
      std::vector<uint32_t>().swap(s->place);
      s->place_shift = 64;
    }
  }
}

void SparseAccumulator::AdaptGranules() {
  if (!adapt_granules_ || num_stripes_ == 1) return;
  size_t total = 0, most = 0;
  for (const SparseRows& t : taken_) {
    total += t.indices.size();
    most = std::max(most, t.indices.size());
  }
  if (total < 8 * static_cast<size_t>(num_stripes_)) return;  // too few rows to tell
  const int coarse = GranuleShift(kCoarseGranuleRows), fine = GranuleShift(kFineGranuleRows);
  // An adder's share of the step's rows, but at most a quarter of the stripes' count of adders:
  // even rows give some stripe more than 1 / num_stripes_ of them, so the bar to go fine is at
  // least 4 times a stripe's even share, and the bar to go back at least twice it (reachable).
  const auto adders = static_cast<size_t>(std::min<int64_t>(adders_, std::max<int64_t>(1, num_stripes_ / 4)));
  if (granule_shift_ == coarse) {
    if (most * adders > total) DealGranules(fine);
    return;
  }
  // Fine now: how would these rows have spread over coarse granules?
  std::array<size_t, kMaxStripes> in{};
  for (const SparseRows& t : taken_) {
    for (int64_t row : t.indices) ++in[static_cast<size_t>((row >> coarse) % num_stripes_)];
  }
  if (*std::max_element(in.begin(), in.begin() + num_stripes_) * adders * 2 <= total) DealGranules(coarse);
}

SparseAccumulator::~SparseAccumulator() = default;

void SparseAccumulator::ReserveIn(Stripe* s, size_t rows) {
  // Every row of this gradient, and of those promised, new: room for all of them (at most the
  // stripe's rows), so that merging allocates nothing and a take allocates nothing either.
  s->mu.AssertHeld();  // the caller's
  const size_t most_rows = static_cast<size_t>(s->rows_in);
  const size_t row_bytes = static_cast<size_t>(row_elements_) * DTypeSize(dtype_);
  const size_t most = s->rows.size() + s->promised + rows;
  s->ReservePlaces(most, hash_multiplier_);
  Reserve(s->rows, most, most_rows);
  Reserve(s->counts, most, most_rows);
  Reserve(s->sums, most * row_bytes, most_rows * row_bytes);
  Reserve(s->order, most, most_rows);
  Reserve(s->merged, most, most_rows);
  // One run more for this gradient, and SortOrder's end mark.
  Reserve(s->run_starts, s->run_starts.size() + s->promised_runs + 2, most_rows + 1);
  s->promised += rows;
  ++s->promised_runs;
}

template <typename T>
void SparseAccumulator::MergeInto(Stripe* s, const SparseGradRef& g, const Slice* slices, size_t count, size_t rows) {
  s->mu.AssertHeld();
  const size_t row_bytes = static_cast<size_t>(row_elements_) * sizeof(T);
  const auto* in = static_cast<const uint8_t*>(g.values);
  const size_t first_new = s->rows.size();
  for (size_t c = 0; c < count; ++c) {
    // The gradient's rows a stripe takes are spread over it (a granule's at a time): the first row
    // of the slice 4 ahead is fetched meanwhile (a slice's own rows follow each other).
    if (c + 4 < count) PrefetchRow(in + static_cast<size_t>(slices[c + 4].first) * row_bytes, row_bytes, false);
    for (uint32_t b = slices[c].first; b < slices[c].second; ++b) {
      const int64_t row = g.indices[b];  // checked: in this stripe
      const uint8_t* y = in + static_cast<size_t>(b) * row_bytes;
      uint32_t* at = s->Place(row, hash_multiplier_);
      if (*at == 0) {
        s->sums.insert(s->sums.end(), y, y + row_bytes);
        s->rows.push_back(row);
        s->counts.push_back(1);
        *at = static_cast<uint32_t>(s->rows.size());
      } else {  // held: the row held first plus this one (TF's merge adds in the same order), count + 1
        T* x = reinterpret_cast<T*>(s->sums.data() + static_cast<size_t>(*at - 1) * row_bytes);
        const T* add = reinterpret_cast<const T*>(y);
        for (int64_t k = 0; k < row_elements_; ++k) x[k] = x[k] + add[k];
        ++s->counts[*at - 1];
      }
    }
  }
  // This gradient's new rows in the stripe follow in increasing order (its indices do): one run.
  if (s->rows.size() > first_new) s->run_starts.push_back(static_cast<uint32_t>(first_new));
  s->promised -= rows;
  --s->promised_runs;
}

namespace {

// An Add's scratch, per thread: where each slice of its gradient begins and its stripe, in row
// order; then the slices (begin, end) grouped by stripe. Kept (a steady Add allocates nothing)
// while it holds at most kKeptSlices slices (16 bytes each); a bigger gradient's is let go after.
struct AddScratch {
  static constexpr size_t kKeptSlices = size_t{1} << 16;
  std::vector<uint32_t> begins;
  std::vector<uint32_t> stripes;
  std::vector<std::pair<uint32_t, uint32_t>> grouped;
  void Trim() {
    if (begins.capacity() <= kKeptSlices && grouped.capacity() <= kKeptSlices) return;
    std::vector<uint32_t>().swap(begins);
    std::vector<uint32_t>().swap(stripes);
    std::vector<std::pair<uint32_t, uint32_t>>().swap(grouped);
  }
};
thread_local AddScratch add_scratch;

}  // namespace

void SparseAccumulator::Add(const PendingAdd& add) {
  const SparseGradRef& g = add.grad;
  if (g.nnz == 0) return;
  const auto nnz = static_cast<uint32_t>(g.nnz);  // at most kMaxRows: the indices increase
  // The slices of rows each stripe takes, and how many rows: a slice per granule the gradient
  // touches (its indices increase, so a granule's rows are consecutive), grouped by stripe.
  std::array<size_t, kMaxStripes> rows_in{};
  std::array<uint32_t, kMaxStripes + 1> first_slice{};  // where each stripe's slices begin
  const Slice whole{0, nnz};
  const Slice* all = &whole;
  ScopeExit trim([] { add_scratch.Trim(); });
  if (num_stripes_ == 1) {
    rows_in[0] = nnz;
    first_slice[1] = 1;
  } else {
    AddScratch& scratch = add_scratch;
    scratch.begins.clear();
    scratch.stripes.clear();
    int64_t granule = -1;
    for (uint32_t b = 0; b < nnz; ++b) {
      const int64_t here = g.indices[b] >> granule_shift_;
      if (here == granule) continue;
      granule = here;
      const auto stripe = static_cast<uint32_t>(here % num_stripes_);
      scratch.begins.push_back(b);
      scratch.stripes.push_back(stripe);
      ++first_slice[stripe + 1];
    }
    for (int64_t k = 0; k < num_stripes_; ++k) first_slice[k + 1] += first_slice[k];
    std::array<uint32_t, kMaxStripes> next;
    std::copy(first_slice.begin(), first_slice.begin() + num_stripes_, next.begin());
    const size_t found = scratch.begins.size();
    scratch.grouped.resize(found);
    for (size_t f = 0; f < found; ++f) {
      const uint32_t stripe = scratch.stripes[f];
      const uint32_t begin = scratch.begins[f], end = f + 1 < found ? scratch.begins[f + 1] : nnz;
      scratch.grouped[next[stripe]++] = {begin, end};
      rows_in[stripe] += end - begin;
    }
    all = scratch.grouped.data();
  }
  // First room in every stripe it touches, then the rows: a failed allocation leaves no row of
  // it added (what it reserved stays as capacity, what it promised is given back).
  int64_t reserved = 0;
  try {
    for (; reserved < num_stripes_; ++reserved) {
      if (rows_in[reserved] == 0) continue;
      Stripe* s = &stripes_[reserved];
      MutexLock lock(&s->mu);
      ReserveIn(s, rows_in[reserved]);
    }
  } catch (...) {
    for (int64_t k = 0; k < reserved; ++k) {
      if (rows_in[k] == 0) continue;
      Stripe* s = &stripes_[k];
      MutexLock lock(&s->mu);
      s->promised -= rows_in[k];
      --s->promised_runs;
    }
    throw;
  }
  // Concurrent Adds start at different stripes, so they rarely wait for each other's.
  const int64_t start =
      static_cast<int64_t>(next_start_.fetch_add(1, std::memory_order_relaxed) % static_cast<uint64_t>(num_stripes_));
  for (int64_t j = 0; j < num_stripes_; ++j) {
    const int64_t k = (start + j) % num_stripes_;
    if (rows_in[k] == 0) continue;
    Stripe* s = &stripes_[k];
    const Slice* mine = all + first_slice[k];
    const size_t count = first_slice[k + 1] - first_slice[k];
    MutexLock lock(&s->mu);
    if (dtype_ == DType::kFloat32) {
      MergeInto<float>(s, g, mine, count, rows_in[k]);
    } else {
      MergeInto<double>(s, g, mine, count, rows_in[k]);
    }
  }
}

template <typename T>
void SparseAccumulator::TakeStripe(int64_t i) {
  Stripe* s = &stripes_[i];
  MutexLock lock(&s->mu);
  s->ForgetPlaces();
  if (reduction_ == Reduction::kMean) {
    T* v = reinterpret_cast<T*>(s->sums.data());
    for (size_t r = 0; r < s->rows.size(); ++r) {
      if (s->counts[r] <= 1) continue;
      const T c = static_cast<T>(s->counts[r]);
      for (int64_t k = 0; k < row_elements_; ++k) v[r * static_cast<size_t>(row_elements_) + k] /= c;
    }
  }
  s->SortOrder();
  // The rows and sums are the result as they are (no copy); ReleaseTaken gives the stripe the
  // last take's buffers for the next step's rows.
  SparseRows& t = taken_[static_cast<size_t>(i)];
  t.indices.swap(s->rows);
  t.values.swap(s->sums);
  t.order.swap(s->order);
  s->rows.clear();
  s->sums.clear();
  s->order.clear();
  s->counts.clear();
}

Result<bool> SparseAccumulator::BeginAdd(int64_t local_step, const SparseGradRef& g, bool counts, uint64_t source,
                                         PendingAdd* add) {
  add->add = false;
  auto part = unfinished_.find(source);
  if (local_step < step_) {
    if (part != unfinished_.end()) unfinished_.erase(part);  // stale: the whole gradient goes
    return false;
  }
  if (!counts || part != unfinished_.end()) {
    Unfinished& u = part != unfinished_.end() ? part->second : unfinished_[source];
    const auto* bytes = static_cast<const uint8_t*>(g.values);
    if (g.nnz > 0 && !u.indices.empty() && g.indices[0] <= u.indices.back()) {
      return InvalidArgument("a sparse gradient's rows continue at index " + std::to_string(g.indices[0]) +
                             ", not after the last part's " + std::to_string(u.indices.back()));
    }
    // Both grown first (geometrically: a gradient of many frames is not copied again at each):
    // a failed allocation leaves the rows kept so far consistent.
    const size_t rows = static_cast<size_t>(declared_[0]);  // its rows increase: at most this many
    Reserve(u.indices, u.indices.size() + static_cast<size_t>(g.nnz), rows);
    Reserve(u.values, u.values.size() + g.values_bytes, rows * static_cast<size_t>(row_elements_) * DTypeSize(dtype_));
    u.indices.insert(u.indices.end(), g.indices, g.indices + g.nnz);
    u.values.insert(u.values.end(), bytes, bytes + g.values_bytes);
    if (!counts) return true;
    add->whole_indices = std::move(u.indices);
    add->whole_values = std::move(u.values);
    unfinished_.erase(source);
    Shape shape = g.values_shape;
    shape[0] = static_cast<int64_t>(add->whole_indices.size());
    add->grad = {add->whole_indices.data(),
                 static_cast<int64_t>(add->whole_indices.size()),
                 g.dtype,
                 std::move(shape),
                 add->whole_values.data(),
                 add->whole_values.size(),
                 g.dense_shape};
  } else {
    add->grad = g;
  }
  add->add = true;
  ++in_flight_;
  return true;
}

uint64_t SparseAccumulator::StagedBytes() const {
  uint64_t bytes = 0;
  for (const auto& [source, u] : unfinished_) bytes += u.indices.capacity() * sizeof(int64_t) + u.values.capacity();
  return bytes;
}

uint64_t SparseAccumulator::StagingGrowth(int64_t local_step, const SparseGradRef& g, bool counts,
                                          uint64_t source) const {
  auto part = unfinished_.find(source);
  if (local_step < step_ || (counts && part == unfinished_.end())) return 0;  // dropped, or added at once
  // As BeginAdd grows them.
  const size_t rows = static_cast<size_t>(declared_[0]);
  const size_t most_values = rows * static_cast<size_t>(row_elements_) * DTypeSize(dtype_);
  size_t indices = 0, indices_cap = 0, values = 0, values_cap = 0;
  if (part != unfinished_.end()) {
    indices = part->second.indices.size();
    indices_cap = part->second.indices.capacity();
    values = part->second.values.size();
    values_cap = part->second.values.capacity();
  }
  const size_t grown =
      (Grown(indices_cap, indices + static_cast<size_t>(g.nnz), rows) - indices_cap) * sizeof(int64_t) +
      (Grown(values_cap, values + g.values_bytes, most_values) - values_cap);
  return grown;
}

Result<bool> SparseAccumulator::ApplyGrad(int64_t local_step, const SparseGradRef& g, bool counts, uint64_t source) {
  PSD_RETURN_IF_ERROR(Validate(g));
  PendingAdd add;
  Result<bool> accepted = BeginAdd(local_step, g, counts, source, &add);
  if (!accepted.ok() || !add.add) return accepted;
  try {
    Add(add);
  } catch (...) {
    CancelAdd();
    throw;
  }
  EndAdd();
  return true;
}

void SparseAccumulator::FinishTake(int* count) {
  ++step_;
  for (int64_t i = 0; i < num_stripes_; ++i) {
    if (dtype_ == DType::kFloat32) {
      TakeStripe<float>(i);
    } else {
      TakeStripe<double>(i);
    }
  }
  // No rows held now (an unfinished gradient's are kept apart): the next step's may be dealt
  // otherwise.
  taken_granule_shift_ = granule_shift_;
  AdaptGranules();
  *count = counter_;
  counter_ = 0;
}

Result<bool> SparseAccumulator::TryTakeGrad(int num_required, int* count) {
  if (num_required <= 0) {
    return InvalidArgument("Argument num_required must be positive, but was " + std::to_string(num_required));
  }
  if (counter_ < num_required) return false;
  FinishTake(count);
  return true;
}

void SparseAccumulator::ForceTake(int* count) {
  if (counter_ > 0) return FinishTake(count);
  // Nothing counted, so no rows either (a gradient's rows count with it): an empty result, and
  // the row buffers stay where they are for the next step's rows.
  for (int64_t i = 0; i < num_stripes_; ++i) {
    Stripe* s = &stripes_[i];
    MutexLock lock(&s->mu);
    s->ClearRows();
    SparseRows& t = taken_[static_cast<size_t>(i)];
    t.indices.clear();
    t.values.clear();
    t.order.clear();
  }
  ++step_;
  *count = 0;
}

bool SparseAccumulator::SetGlobalStep(int64_t new_step) {
  bool lowered = new_step < step_;
  step_ = new_step;
  return lowered;
}

void SparseAccumulator::ReleaseTaken(std::vector<SparseRows>* given) {
  // The first time the caller has no buffers yet: the spare set (made with taken_) goes to it.
  if (given->size() != taken_.size()) {
    given->clear();
    given->swap(spare_taken_);
    if (given->size() != taken_.size()) given->resize(taken_.size());  // not expected: given twice of a wrong size
  }
  given->swap(taken_);
  for (int64_t i = 0; i < num_stripes_; ++i) {
    SparseRows& back = taken_[static_cast<size_t>(i)];  // applied: their contents are not rows of ours
    back.indices.clear();
    back.values.clear();
    back.order.clear();
    // What came back (the take before's) holds the next step's rows, unless rows came in
    // meanwhile; the rest goes: two sets of row buffers in all, the stripe's and the caller's.
    // (None bigger than the stripe's rows now: its granules may have changed since they grew.)
    Stripe* s = &stripes_[i];
    MutexLock lock(&s->mu);
    const auto most = static_cast<size_t>(s->rows_in);
    const size_t most_bytes = most * static_cast<size_t>(row_elements_) * DTypeSize(dtype_);
    auto fits = [](const auto& mine, const auto& given, size_t limit) {
      return mine.empty() && mine.capacity() < given.capacity() && given.capacity() <= limit;
    };
    if (fits(s->rows, back.indices, most)) s->rows.swap(back.indices);
    if (fits(s->sums, back.values, most_bytes)) s->sums.swap(back.values);
    if (fits(s->order, back.order, most)) s->order.swap(back.order);
    std::vector<int64_t>().swap(back.indices);
    std::vector<uint8_t>().swap(back.values);
    std::vector<uint32_t>().swap(back.order);
  }
}

}  // namespace psd::server
