#include "core/accumulator.h"

#include <algorithm>
#include <cstring>

#include "psd/half.h"

namespace psd::server {
namespace {

template <typename T>
void AddTyped(T* __restrict dst, const T* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
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
      sum_(static_cast<size_t>(num_elements_) * DTypeSize(dtype)),
      num_stripes_(std::max<int64_t>(1, (num_elements_ + kStripeElements - 1) / kStripeElements)),
      stripes_(std::make_unique<Stripe[]>(static_cast<size_t>(num_stripes_))),
      deterministic_(deterministic) {}

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
  ++in_flight_;
  return true;
}

void DenseAccumulator::EndAdd() {
  --in_flight_;
  ++counter_;
}

void DenseAccumulator::AddRange(DType dtype, const void* data, int64_t begin, int64_t end, bool first) {
  const size_t n = static_cast<size_t>(end - begin);
  const size_t in_size = DTypeSize(dtype), out_size = DTypeSize(dtype_);
  const void* src = static_cast<const char*>(data) + static_cast<size_t>(begin) * in_size;
  void* dst = static_cast<char*>(sum_.data()) + static_cast<size_t>(begin) * out_size;
  if (dtype != dtype_) {  // a half gradient into float32: converted while it is added
    if (first) {
      ConvertElements(src, dtype, dst, dtype_, n);
    } else {
      AddConvertedInto(static_cast<float*>(dst), src, dtype, n);
    }
  } else if (first) {
    std::memcpy(dst, src, n * out_size);
  } else {
    AddInto(dtype_, dst, src, static_cast<int64_t>(n));
  }
}

void DenseAccumulator::Add(DType dtype, const void* data, std::string_view replica) {
  if (num_elements_ == 0) return;
  if (deterministic_) {
    std::unique_ptr<Buffer> slot;
    {
      MutexLock lock(&slots_mu_);
      if (!free_slots_.empty()) {
        slot = std::move(free_slots_.back());
        free_slots_.pop_back();
      }
    }
    if (!slot) slot = std::make_unique<Buffer>(sum_.bytes(), Buffer::Uninitialized{});
    if (dtype != dtype_) {
      ConvertElements(data, dtype, slot->data(), dtype_, static_cast<size_t>(num_elements_));
    } else {
      std::memcpy(slot->data(), data, sum_.bytes());
    }
    MutexLock lock(&slots_mu_);
    slots_.push_back({std::string(replica), arrivals_++, std::move(slot)});
    return;
  }
  // round_ is stable while this add is in flight: a take waits for in_flight() == 0.
  const uint64_t round = round_;
  const int64_t start =
      static_cast<int64_t>(next_start_.fetch_add(1, std::memory_order_relaxed) % static_cast<uint64_t>(num_stripes_));
  for (int64_t k = 0; k < num_stripes_; ++k) {
    int64_t i = (start + k) % num_stripes_;
    int64_t begin = i * kStripeElements, end = std::min(num_elements_, begin + kStripeElements);
    Stripe& stripe = stripes_[static_cast<size_t>(i)];
    MutexLock lock(&stripe.mu);
    bool first = stripe.filled_round != round;
    stripe.filled_round = round;
    AddRange(dtype, data, begin, end, first);
  }
}

void DenseAccumulator::SumSlots() {
  MutexLock lock(&slots_mu_);
  std::sort(slots_.begin(), slots_.end(), [](const Slot& a, const Slot& b) {
    return a.replica != b.replica ? a.replica < b.replica : a.arrival < b.arrival;
  });
  for (size_t k = 0; k < slots_.size(); ++k) {
    if (k == 0) {
      std::memcpy(sum_.data(), slots_[k].values->data(), sum_.bytes());
    } else {
      AddInto(dtype_, sum_.data(), slots_[k].values->data(), num_elements_);
    }
    free_slots_.push_back(std::move(slots_[k].values));
  }
  slots_.clear();
  arrivals_ = 0;
}

Result<bool> DenseAccumulator::TryTakeGrad(int num_required, int* count) {
  if (num_required <= 0) {
    return InvalidArgument("Argument num_required must be positive, but was " + std::to_string(num_required));
  }
  if (counter_ < num_required || in_flight_ > 0) return false;  // an add in flight belongs to this step
  ForceTake(count);
  return true;
}

void DenseAccumulator::ForceTake(int* count) {
  if (deterministic_) SumSlots();
  ++round_;  // the next add into each stripe starts its sum over
  ++step_;
  divisor_ = reduction_ == Reduction::kMean && counter_ > 1 ? counter_ : 1;
  *count = counter_;
  counter_ = 0;
}

bool DenseAccumulator::SetGlobalStep(int64_t new_step) {
  bool lowered = new_step < step_;
  step_ = new_step;
  return lowered;
}

}  // namespace psd::server
