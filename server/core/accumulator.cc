#include "core/accumulator.h"

#include <algorithm>
#include <climits>
#include <cstring>

#include "psd/half.h"

namespace psd::server {
namespace {

template <typename T>
void AddTyped(T* __restrict dst, const T* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

// dst = a + b: a part's held first gradient and its second, summed in one pass (the same floats
// as copying a and adding b).
template <typename T>
void SumTyped(T* __restrict dst, const T* __restrict a, const T* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = a[i] + b[i];
}

// SumTyped for float32 or float64, as AddInto.
void SumInto(DType dtype, void* dst, const void* a, const void* b, int64_t n) {
  if (dtype == DType::kFloat32) {
    SumTyped(static_cast<float*>(dst), static_cast<const float*>(a), static_cast<const float*>(b), n);
  } else {
    SumTyped(static_cast<double*>(dst), static_cast<const double*>(a), static_cast<const double*>(b), n);
  }
}

}  // namespace

void AddInto(DType dtype, void* dst, const void* src, int64_t n) {
  if (dtype == DType::kFloat32) {
    AddTyped(static_cast<float*>(dst), static_cast<const float*>(src), n);
  } else {
    AddTyped(static_cast<double*>(dst), static_cast<const double*>(src), n);
  }
}

DenseAccumulator::DenseAccumulator(DType dtype, Shape shape, Reduction reduction, int64_t initial_step,
                                   bool deterministic)
    : dtype_(dtype),
      shape_(std::move(shape)),
      reduction_(reduction),
      num_elements_(NumElements(shape_)),
      step_(initial_step),
      bytes_(static_cast<size_t>(num_elements_) * DTypeSize(dtype)),
      num_stripes_(std::max<int64_t>(1, (num_elements_ + kStripeElements - 1) / kStripeElements)),
      stripes_(std::make_unique<Stripe[]>(static_cast<size_t>(num_stripes_))),
      num_parts_(std::max<int64_t>(1, (num_elements_ + kPartElements - 1) / kPartElements)),
      part_round_(std::make_unique<uint64_t[]>(static_cast<size_t>(num_parts_))),
      deterministic_(deterministic) {
  // One pointer per part (8 bytes per 2 KiB): what lets a held gradient go uncopied.
  if (!deterministic_) {
    held_ = std::make_unique<const char*[]>(static_cast<size_t>(num_parts_));
    held_last_ = std::make_unique<const char*[]>(static_cast<size_t>(num_parts_));
  }
  ProvideSum(std::make_shared<Buffer>(bytes_));  // zeros: what a take of nothing finds
}

Status CheckGradientDType(DType want, DType got) {
  if (got == want) return Status::Ok();
  // A float32 accumulator (a float32 or half variable's) takes half gradients, converted as added.
  if (want == DType::kFloat32 && IsHalf(got)) return Status::Ok();
  return InvalidArgument(std::string("dtype mismatch: accumulator is ") + DTypeName(want) + ", gradient is " +
                         DTypeName(got));
}

Status DenseAccumulator::Check(DType want_dtype, const Shape& want_shape, DType dtype, const Shape& shape,
                               size_t bytes) {
  PSD_RETURN_IF_ERROR(CheckGradientDType(want_dtype, dtype));
  if (shape != want_shape) {
    return InvalidArgument("Shape mismatch: expected " + ShapeString(want_shape) + ", got " + ShapeString(shape));
  }
  size_t need = static_cast<size_t>(NumElements(want_shape)) * DTypeSize(dtype);
  if (bytes != need) {
    return InvalidArgument("gradient data has " + std::to_string(bytes) + " bytes, shape " + ShapeString(shape) +
                           " of " + DTypeName(dtype) + " needs " + std::to_string(need));
  }
  return Status::Ok();
}

Result<bool> DenseAccumulator::ApplyGrad(int64_t local_step, DType dtype, const Shape& shape, const void* data,
                                         size_t bytes) {
  PSD_RETURN_IF_ERROR(Validate(dtype, shape, bytes));
  return AddChecked(local_step, dtype, data);
}

bool DenseAccumulator::AddChecked(int64_t local_step, DType dtype, const void* data, std::string_view replica) {
  if (!BeginAdd(local_step)) return false;
  Add(dtype, data, replica);
  EndAdd();
  return true;
}

bool DenseAccumulator::BeginAdd(int64_t local_step) {
  if (local_step < step_) return false;
  if (deterministic_) {
    MutexLock lock(&slots_mu_);
    if (max_slots_ > 0 && static_cast<int64_t>(slots_.size()) + in_flight_ >= max_slots_) return false;
  }
  ++in_flight_;
  return true;
}

void DenseAccumulator::LimitSlots(int max_slots) {
  MutexLock lock(&slots_mu_);
  max_slots_ = max_slots;
}

std::shared_ptr<Buffer> DenseAccumulator::ReleaseSum() {
  MutexLock lock(&sum_mu_);
  sum_at_.store(nullptr);
  return std::move(sum_);
}

void DenseAccumulator::ProvideSum(std::shared_ptr<Buffer> buffer) {
  MutexLock lock(&sum_mu_);
  if (sum_ || !buffer || buffer->bytes() != bytes_) return;
  sum_ = std::move(buffer);
  sum_at_.store(sum_.get());
}

char* DenseAccumulator::SumData() {
  if (Buffer* at = sum_at_.load()) return static_cast<char*>(at->data());
  MutexLock lock(&sum_mu_);
  if (!sum_) {
    sum_ = std::make_shared<Buffer>(bytes_, Buffer::Uninitialized{});
    sum_at_.store(sum_.get());
  }
  return static_cast<char*>(sum_->data());
}

void DenseAccumulator::EndAdd() {
  --in_flight_;
  ++counter_;
}

void DenseAccumulator::AddRange(DType dtype, const void* src, int64_t begin, int64_t end, bool first) {
  const size_t n = static_cast<size_t>(end - begin);
  const size_t out_size = DTypeSize(dtype_);
  void* dst = SumData() + static_cast<size_t>(begin) * out_size;
  if (first) {
    ConvertElements(src, dtype, dst, dtype_, n);  // a copy, or a half gradient converted to float32
  } else if (dtype != dtype_) {
    AddConvertedInto(static_cast<float*>(dst), src, dtype, n);
  } else {
    AddInto(dtype_, dst, src, static_cast<int64_t>(n));
  }
}

namespace {

// A part's state in its round: first (no gradient yet this round), or its held gradients (kFirstHeld:
// its first gradient pointed at, nothing in the sum; kLastHeld: its latest one, not added yet),
// or neither (its sum holds every gradient).
constexpr int kSummed = 0, kFirstHeld = 1, kLastHeld = 2, kFirstOfRound = 4;

}  // namespace

int DenseAccumulator::PartState(int64_t e, uint64_t round) const {
  const size_t p = static_cast<size_t>(e / kPartElements);
  if (part_round_[p] != round) return round == round_ ? kFirstOfRound : kSummed;
  if (!held_) return kSummed;
  return (held_[p] != nullptr ? kFirstHeld : 0) | (held_last_[p] != nullptr ? kLastHeld : 0);
}

int64_t DenseAccumulator::RunEnd(int64_t at, int64_t end, uint64_t round) const {
  // Parts alike from `at`: the same state, and the held bytes (if any) following one another.
  const size_t out_size = DTypeSize(dtype_);
  const int state = PartState(at, round);
  const size_t p0 = static_cast<size_t>(at / kPartElements);
  auto next_part = [&](int64_t e) { return std::min(end, (e / kPartElements + 1) * kPartElements); };
  int64_t run_end = next_part(at);
  while (run_end < end && PartState(run_end, round) == state) {
    const size_t p = static_cast<size_t>(run_end / kPartElements);
    const size_t offset = static_cast<size_t>(run_end - at) * out_size;
    if ((state & kFirstHeld) && held_[p] != held_[p0] + offset) break;
    if ((state & kLastHeld) && held_last_[p] != held_last_[p0] + offset) break;
    run_end = next_part(run_end);
  }
  return run_end;
}

void DenseAccumulator::SetHeld(const char** at, int64_t begin, int64_t end, const char* src) const {
  const size_t out_size = DTypeSize(dtype_);
  for (int64_t e = begin; e < end; e = (e / kPartElements + 1) * kPartElements) {
    at[static_cast<size_t>(e / kPartElements)] =
        src == nullptr ? nullptr : src + static_cast<size_t>(e - begin) * out_size;
  }
}

void DenseAccumulator::AddToStripe(int64_t i, DType dtype, const void* data, int64_t base, int64_t begin, int64_t end,
                                   bool held) {
  // round_ is stable while an add is in flight: a take waits for in_flight() == 0.
  const size_t in_size = DTypeSize(dtype), out_size = DTypeSize(dtype_);
  MutexLock lock(&stripes_[static_cast<size_t>(i)].mu);
  // Runs of parts alike (RunEnd), one call each.
  auto src = [&](int64_t e) { return static_cast<const char*>(data) + static_cast<size_t>(e - base) * in_size; };
  int64_t at = begin;
  while (at < end) {
    int state = PartState(at, round_);
    const int64_t run_end = RunEnd(at, end, round_);
    const size_t p = static_cast<size_t>(at / kPartElements);
    auto dst = [&] { return SumData() + static_cast<size_t>(at) * out_size; };  // a held gradient writes nothing
    const int64_t n = run_end - at;
    if (state == kFirstOfRound) {
      for (int64_t e = at; e < run_end; e = (e / kPartElements + 1) * kPartElements) {
        part_round_[static_cast<size_t>(e / kPartElements)] = round_;
      }
      if (held_) {
        SetHeld(held_.get(), at, run_end, held ? src(at) : nullptr);  // PrepareAdd: dtype == dtype_
        SetHeld(held_last_.get(), at, run_end, nullptr);
      }
      if (!held) AddRange(dtype, src(at), at, run_end, true);
      at = run_end;
      continue;
    }
    if (state & kLastHeld) {  // the part's pending gradient is added first (arrival order)
      const char* later = held_last_[p];
      SetHeld(held_last_.get(), at, run_end, nullptr);
      if (state & kFirstHeld) {
        SumInto(dtype_, dst(), held_[p], later, n);
        SetHeld(held_.get(), at, run_end, nullptr);
      } else {
        AddInto(dtype_, dst(), later, n);
      }
      state = kSummed;
    }
    if (held) {  // pointed at, to be added by the part's next add or the take's apply
      SetHeld(held_last_.get(), at, run_end, src(at));
    } else if (state & kFirstHeld) {
      const char* first = held_[p];
      SetHeld(held_.get(), at, run_end, nullptr);
      if (dtype == dtype_) {
        SumInto(dtype_, dst(), first, src(at), n);
      } else {  // a half gradient onto a held float32 one: copy, then add converted
        std::memcpy(dst(), first, static_cast<size_t>(n) * out_size);
        AddRange(dtype, src(at), at, run_end, false);
      }
    } else {
      AddRange(dtype, src(at), at, run_end, false);
    }
    at = run_end;
  }
}

void DenseAccumulator::ResolveStripe(int64_t i) {
  const size_t out_size = DTypeSize(dtype_);
  const int64_t begin = i * kStripeElements, end = std::min(num_elements_, (i + 1) * kStripeElements);
  for (int64_t at = begin; at < end;) {
    const size_t p = static_cast<size_t>(at / kPartElements);
    const int64_t part_end = std::min(end, at + kPartElements);
    const int64_t n = part_end - at;
    if (part_round_[p] == round_) {
      char* dst = SumData() + static_cast<size_t>(at) * out_size;
      if (held_[p] != nullptr && held_last_[p] != nullptr) {
        SumInto(dtype_, dst, held_[p], held_last_[p], n);
      } else if (held_[p] != nullptr) {
        std::memcpy(dst, held_[p], static_cast<size_t>(n) * out_size);
      } else if (held_last_[p] != nullptr) {
        AddInto(dtype_, dst, held_last_[p], n);
      }
    }
    held_[p] = nullptr;
    held_last_[p] = nullptr;
    at = part_end;
  }
}

void DenseAccumulator::ResolveHeld() {
  if (!holds()) return;
  for (int64_t i = 0; i < num_stripes_; ++i) {
    MutexLock lock(&stripes_[static_cast<size_t>(i)].mu);
    ResolveStripe(i);
  }
  MutexLock lock(&holds_mu_);
  holds_.clear();
}

const void* DenseAccumulator::TakenGrad(const void* sum, int64_t begin, int64_t end, void* scratch,
                                        int64_t* run_end) const {
  const size_t out_size = DTypeSize(dtype_);
  const int state = taken_holds_ ? PartState(begin, taken_round_) : kSummed;
  *run_end = taken_holds_ ? RunEnd(begin, end, taken_round_) : end;
  const size_t p = static_cast<size_t>(begin / kPartElements);
  const char* in_sum = static_cast<const char*>(sum) + static_cast<size_t>(begin) * out_size;
  const int64_t n = *run_end - begin;
  switch (state) {
    case kFirstHeld:
      return held_[p];
    case kFirstHeld | kLastHeld:
      SumInto(dtype_, scratch, held_[p], held_last_[p], n);
      return scratch;
    case kLastHeld:
      SumInto(dtype_, scratch, in_sum, held_last_[p], n);
      return scratch;
    default:
      return in_sum;
  }
}

void DenseAccumulator::DropTakenHolds() {
  if (!taken_holds_) return;
  std::fill_n(held_.get(), num_parts_, nullptr);
  std::fill_n(held_last_.get(), num_parts_, nullptr);
  taken_holds_ = false;
  MutexLock lock(&holds_mu_);
  holds_.clear();
}

bool DenseAccumulator::holds() const {
  MutexLock lock(&holds_mu_);
  return !holds_.empty();
}

bool DenseAccumulator::PrepareAdd(DType dtype, const std::shared_ptr<const void>& hold, int64_t s0, int64_t s1) {
  const bool held = hold && held_ && dtype == dtype_;
  // An add that copies writes every part it reaches. A held one writes a part where it finds a
  // gradient pending (pointed at by a held add that came second, after one that came first): two
  // adds other than this one. Of a stripe's first two held adds of the round, at most one is among
  // those two, and the other took the buffer here before it touched anything; it stays until the
  // take. So those two may go without it, on every stripe they reach.
  bool writes = !held;
  for (int64_t i = s0; i < s1 && !writes; ++i) {
    writes = stripes_[static_cast<size_t>(i)].held_adds.fetch_add(1, std::memory_order_relaxed) >= 2;
  }
  if (writes) SumData();
  if (!held) return false;
  MutexLock lock(&holds_mu_);
  if (holds_.empty() || holds_.back() != hold) holds_.push_back(hold);
  return true;
}

std::unique_ptr<Buffer> DenseAccumulator::TakeFreeSlot() {
  if (free_slots_.empty()) return std::make_unique<Buffer>(bytes_, Buffer::Uninitialized{});
  std::unique_ptr<Buffer> slot = std::move(free_slots_.back());
  free_slots_.pop_back();
  return slot;
}

Buffer* DenseAccumulator::ChunkSlot(std::string_view replica, uint64_t source, int64_t p0, int64_t p1) {
  MutexLock lock(&slots_mu_);
  auto fits = [&](const Slot& s) {
    if (s.replica != replica || s.source != source || s.parts.empty()) return false;
    for (int64_t p = p0; p < p1; ++p) {
      if (s.parts[static_cast<size_t>(p)]) return false;
    }
    return true;
  };
  auto it = std::find_if(slots_.begin(), slots_.end(), fits);  // slots_ is in arrival order
  if (it == slots_.end()) {
    slots_.push_back({std::string(replica), arrivals_++, TakeFreeSlot(), std::vector<bool>(num_parts_, false), source});
    it = slots_.end() - 1;
  }
  for (int64_t p = p0; p < p1; ++p) it->parts[static_cast<size_t>(p)] = true;
  it->filled += p1 - p0;  // none of them was filled (fits)
  if (it->filled == num_parts_) {
    it->complete = true;
    ++completed_;  // counted as a whole gradient by the next EndAddChunk
  }
  return it->values.get();
}

void DenseAccumulator::AddToStripes(int64_t s0, int64_t count, int64_t start, DType dtype, const void* data,
                                    int64_t base, int64_t begin, int64_t end, ThreadPool* helpers, bool held) {
  auto add = [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t i = s0 + (start + k) % count;
      AddToStripe(i, dtype, data, base, std::max(begin, i * kStripeElements), std::min(end, (i + 1) * kStripeElements),
                  held);
    }
  };
  // Waking a helper costs a futex and a context switch: worth it for two whole stripes or more,
  // not for a 1 MiB chunk that happens to straddle two (a TCP push's chunks).
  if (helpers == nullptr || count < 2 || end - begin < 2 * kStripeElements) return add(0, count);
  helpers->ParallelFor(count, 1, add);
}

void DenseAccumulator::Add(DType dtype, const void* data, std::string_view replica, ThreadPool* helpers,
                           const std::shared_ptr<const void>& hold) {
  if (num_elements_ == 0) return;
  if (deterministic_) {
    std::unique_ptr<Buffer> slot;
    {
      MutexLock lock(&slots_mu_);
      slot = TakeFreeSlot();
    }
    ConvertElements(data, dtype, slot->data(), dtype_, static_cast<size_t>(num_elements_));
    MutexLock lock(&slots_mu_);
    slots_.push_back({std::string(replica), arrivals_++, std::move(slot), {}, 0});
    return;
  }
  const int64_t start =
      static_cast<int64_t>(next_start_.fetch_add(1, std::memory_order_relaxed) % static_cast<uint64_t>(num_stripes_));
  const bool held = PrepareAdd(dtype, hold, 0, num_stripes_);  // before anything changes: it may throw
  AddToStripes(0, num_stripes_, start, dtype, data, 0, 0, num_elements_, helpers, held);
}

void DenseAccumulator::AddChunk(DType dtype, const void* data, int64_t offset, int64_t n, std::string_view replica,
                                ThreadPool* helpers, const std::shared_ptr<const void>& hold, uint64_t source) {
  if (n <= 0) return;
  if (deterministic_) {
    const int64_t p0 = offset / kPartElements, p1 = (offset + n + kPartElements - 1) / kPartElements;
    Buffer* slot = ChunkSlot(replica, source, p0, p1);  // this chunk's parts of it are this add's alone
    void* dst = static_cast<char*>(slot->data()) + static_cast<size_t>(offset) * DTypeSize(dtype_);
    ConvertElements(data, dtype, dst, dtype_, static_cast<size_t>(n));
    return;
  }
  const int64_t s0 = offset / kStripeElements, s1 = (offset + n - 1) / kStripeElements + 1;
  const int64_t stripes = s1 - s0;
  const int64_t start =
      static_cast<int64_t>(next_start_.fetch_add(1, std::memory_order_relaxed) % static_cast<uint64_t>(stripes));
  const bool held = PrepareAdd(dtype, hold, s0, s1);  // before anything changes: it may throw
  AddToStripes(s0, stripes, start, dtype, data, offset, offset, offset + n, helpers, held);
}

void DenseAccumulator::DropUnfinished(uint64_t source) {
  if (!deterministic_) return;
  MutexLock lock(&slots_mu_);
  for (auto it = slots_.begin(); it != slots_.end();) {
    if (it->source == source && !it->parts.empty() && !it->complete) {
      free_slots_.push_back(std::move(it->values));  // it never counted (EndAddChunk)
      it = slots_.erase(it);
    } else {
      ++it;
    }
  }
}

void DenseAccumulator::EndAddChunk(int64_t offset, int64_t n) {
  --in_flight_;
  if (deterministic_) {
    // A gradient in chunks counts once all of them came (its slot complete), as a whole one; a
    // slot some chunks never reach never counts, and the take leaves it out.
    MutexLock lock(&slots_mu_);
    counter_ += completed_;
    completed_ = 0;
    return;
  }
  if (n <= 0) return;
  if (!chunked_) {
    part_counts_.assign(static_cast<size_t>(num_parts_), 0);
    min_part_ = 0;
    at_min_ = num_parts_;
    chunked_ = true;
  }
  const int64_t p0 = offset / kPartElements, p1 = (offset + n + kPartElements - 1) / kPartElements;
  for (int64_t p = p0; p < p1; ++p) {
    if (part_counts_[static_cast<size_t>(p)]++ == min_part_) --at_min_;
  }
  if (at_min_ == 0) {  // every part has more now: find the new fewest (once per chunked gradient)
    min_part_ = *std::min_element(part_counts_.begin(), part_counts_.end());
    at_min_ = std::count(part_counts_.begin(), part_counts_.end(), min_part_);
  }
}

Status DenseAccumulator::CheckChunk(DType want_dtype, const Shape& want_shape, DType dtype, const Shape& shape,
                                    size_t bytes, int64_t offset) {
  PSD_RETURN_IF_ERROR(CheckGradientDType(want_dtype, dtype));
  const int64_t total = NumElements(want_shape);
  if (shape.size() != 1 || shape[0] <= 0) {
    return InvalidArgument("a gradient chunk must be a flat [n] with n > 0, got " + ShapeString(shape));
  }
  const int64_t n = shape[0];
  if (offset < 0 || offset >= total || n > total - offset) {
    return InvalidArgument("gradient chunk [" + std::to_string(offset) + ", " + std::to_string(offset) + " + " +
                           std::to_string(n) + ") is outside the variable's " + std::to_string(total) + " elements");
  }
  if (offset % kPartElements != 0 || (offset + n != total && n % kPartElements != 0)) {
    return InvalidArgument("gradient chunk [" + std::to_string(offset) + ", " + std::to_string(offset + n) +
                           ") is not aligned to psd's chunk parts of " + std::to_string(kPartElements) +
                           " elements (HelloReply.chunkElements)");
  }
  size_t need = static_cast<size_t>(n) * DTypeSize(dtype);
  if (bytes != need) {
    return InvalidArgument("gradient chunk has " + std::to_string(bytes) + " bytes, " + std::to_string(n) +
                           " elements of " + DTypeName(dtype) + " need " + std::to_string(need));
  }
  return Status::Ok();
}

void DenseAccumulator::SumSlots() {
  MutexLock lock(&slots_mu_);
  free_slots_.reserve(free_slots_.size() + slots_.size());  // before the sum: the take may throw, not half-way
  std::sort(slots_.begin(), slots_.end(), [](const Slot& a, const Slot& b) {
    return a.replica != b.replica ? a.replica < b.replica : a.arrival < b.arrival;
  });
  // Whole gradients, and gradients in chunks that all came (what counter_ counts); a slot whose
  // chunks did not all come is left out, and freed with the others.
  bool first = true;
  for (const Slot& slot : slots_) {
    if (!slot.parts.empty() && !slot.complete) continue;
    AddRange(dtype_, slot.values->data(), 0, num_elements_, first);
    first = false;
  }
  for (Slot& slot : slots_) free_slots_.push_back(std::move(slot.values));
  slots_.clear();
  arrivals_ = 0;
  completed_ = 0;
}

void DenseAccumulator::SettleParts(int* count) {
  chunked_ = false;
  int most = 0;
  for (int c : part_counts_) most = std::max(most, c);
  if (min_part_ == most) {  // every part has the same gradients' count: one divisor, as for whole adds
    *count = counter_ + most;
    divisor_ = reduction_ == Reduction::kMean && *count > 1 ? *count : 1;
    return;
  }
  // Parts with different counts (a chunk never came, or a forced take): each is divided by its own,
  // in the sum (held parts copied into it first).
  ResolveHeld();
  *count = 0;
  const size_t out_size = DTypeSize(dtype_);
  for (int64_t p = 0; p < num_parts_; ++p) {
    int c = counter_ + part_counts_[static_cast<size_t>(p)];
    if (c > 0 && (*count == 0 || c < *count)) *count = c;  // the fewest of the parts that got any
    int64_t begin = p * kPartElements, end = std::min(num_elements_, begin + kPartElements);
    char* dst = SumData() + static_cast<size_t>(begin) * out_size;
    if (c == 0) {
      std::memset(dst, 0, static_cast<size_t>(end - begin) * out_size);
      if (!unsent_.empty() && unsent_.back().second == begin) {
        unsent_.back().second = end;
      } else {
        unsent_.emplace_back(begin, end);
      }
    } else if (reduction_ == Reduction::kMean && c > 1) {
      if (dtype_ == DType::kFloat32) {
        float* x = reinterpret_cast<float*>(dst);
        for (int64_t e = 0; e < end - begin; ++e) x[e] = x[e] / static_cast<float>(c);  // as the optimizer divides
      } else {
        double* x = reinterpret_cast<double*>(dst);
        for (int64_t e = 0; e < end - begin; ++e) x[e] = x[e] / static_cast<double>(c);
      }
    }
  }
  divisor_ = 1;
}

Result<bool> DenseAccumulator::TryTakeGrad(int num_required, int* count, bool keep_held) {
  if (num_required <= 0) {
    return InvalidArgument("Argument num_required must be positive, but was " + std::to_string(num_required));
  }
  if (num_accumulated() < num_required || in_flight_ > 0) return false;  // an add in flight belongs to this step
  Take(count, keep_held);
  return true;
}

void DenseAccumulator::ForceTake(int* count) { Take(count, false); }

void DenseAccumulator::Take(int* count, bool keep_held) {
  // The sum's buffer first, the take's one allocation (a round of held gradients wrote none):
  // out of memory, the take throws before anything changed, and can be tried again.
  if (counter_ > 0 || chunked_) SumData();
  if (chunked_) unsent_.reserve(static_cast<size_t>(num_parts_ + 1) / 2);  // SettleParts' ranges of parts, at most
  if (!keep_held) ResolveHeld();                                           // held parts: copied (and added) now
  if (deterministic_) SumSlots();
  unsent_.clear();
  if (chunked_) {
    SettleParts(count);
  } else {
    divisor_ = reduction_ == Reduction::kMean && counter_ > 1 ? counter_ : 1;
    *count = counter_;
  }
  taken_holds_ = keep_held && holds();  // SettleParts may have resolved them
  taken_round_ = round_;
  if (*count > 0) SumData();  // taken above (a round of empty tensors wrote nothing)
  ++round_;                   // the next add into each stripe starts its sum over
  for (int64_t i = 0; i < num_stripes_; ++i)
    stripes_[static_cast<size_t>(i)].held_adds.store(0, std::memory_order_relaxed);
  ++step_;
  counter_ = 0;
}

bool DenseAccumulator::SetGlobalStep(int64_t new_step) {
  bool lowered = new_step < step_;
  step_ = new_step;
  return lowered;
}

}  // namespace psd::server
