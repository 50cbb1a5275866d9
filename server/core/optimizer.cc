#include "core/optimizer.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>

#include "base/prefetch.h"

namespace psd::server {
namespace {

// Each optimizer writes one templated Update<T>; this adapter provides both virtual overloads.
// The gradient of element i is g[i] / d: the MEAN's division is fused into the update's pass.
template <typename Derived>
class OptimizerImpl : public Optimizer {
 public:
  explicit OptimizerImpl(OptimizerParams p) : Optimizer(std::move(p)) {}

 protected:
  void Range(const float* value, const float* grad, float* out, float** slots, int64_t begin, int64_t end, int64_t step,
             double lr, float div) const override {
    static_cast<const Derived*>(this)->template Update<float>(value, grad, out, slots, begin, end, step, lr, div);
  }
  void Range(const double* value, const double* grad, double* out, double** slots, int64_t begin, int64_t end,
             int64_t step, double lr, double div) const override {
    static_cast<const Derived*>(this)->template Update<double>(value, grad, out, slots, begin, end, step, lr, div);
  }
};

// var -= lr * grad
class Sgd : public OptimizerImpl<Sgd> {
 public:
  using OptimizerImpl::OptimizerImpl;
  template <typename T>
  void Update(const T* __restrict v, const T* g, T* out, T**, int64_t b, int64_t e, int64_t, double lr, T d) const {
    const T a = static_cast<T>(lr);
    for (int64_t i = b; i < e; ++i) out[i] = v[i] - a * (g[i] / d);
  }
};

// accum = momentum * accum + grad; var -= lr * accum (Nesterov: var -= lr * grad + lr * momentum * accum)
class Momentum : public OptimizerImpl<Momentum> {
 public:
  using OptimizerImpl::OptimizerImpl;
  std::vector<SlotSpec> Slots() const override { return {{"momentum", 0.0}}; }
  template <typename T>
  void Update(const T* v, const T* g, T* out, T** s, int64_t b, int64_t e, int64_t, double lr, T d) const {
    const T a = static_cast<T>(lr), m = static_cast<T>(params().momentum);
    T* acc = s[0];
    if (params().nesterov) {
      for (int64_t i = b; i < e; ++i) {
        const T gi = g[i] / d;
        acc[i] = m * acc[i] + gi;
        out[i] = v[i] - (a * gi + a * m * acc[i]);
      }
    } else {
      for (int64_t i = b; i < e; ++i) {
        const T gi = g[i] / d;
        acc[i] = m * acc[i] + gi;
        out[i] = v[i] - a * acc[i];
      }
    }
  }
};

// accum += grad^2; var -= lr * grad / sqrt(accum)
class Adagrad : public OptimizerImpl<Adagrad> {
 public:
  using OptimizerImpl::OptimizerImpl;
  std::vector<SlotSpec> Slots() const override { return {{"accumulator", params().initial_accumulator}}; }
  template <typename T>
  void Update(const T* v, const T* g, T* out, T** s, int64_t b, int64_t e, int64_t, double lr, T d) const {
    const T a = static_cast<T>(lr);
    T* acc = s[0];
    for (int64_t i = b; i < e; ++i) {
      const T gi = g[i] / d;
      acc[i] += gi * gi;
      out[i] = v[i] - a * gi / std::sqrt(acc[i]);
    }
  }
};

// lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t); m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// var -= lr_t * m / (sqrt(v) + epsilon)   (TF ApplyAdam; PyTorch's bias correction is equivalent
// up to where epsilon sits)
class Adam : public OptimizerImpl<Adam> {
 public:
  using OptimizerImpl::OptimizerImpl;
  std::vector<SlotSpec> Slots() const override { return {{"m", 0.0}, {"v", 0.0}}; }
  template <typename T>
  void Update(const T* v, const T* g, T* out, T** s, int64_t b, int64_t e, int64_t step, double lr, T d) const {
    const double t = static_cast<double>(step);
    const double b1 = params().beta1, b2 = params().beta2;
    const T lr_t = static_cast<T>(lr * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t)));
    const T tb1 = static_cast<T>(b1), tb2 = static_cast<T>(b2), eps = static_cast<T>(params().epsilon);
    T* m = s[0];
    T* vv = s[1];
    for (int64_t i = b; i < e; ++i) {
      const T gi = g[i] / d;
      m[i] = tb1 * m[i] + (T(1) - tb1) * gi;
      vv[i] = tb2 * vv[i] + (T(1) - tb2) * gi * gi;
      out[i] = v[i] - lr_t * m[i] / (std::sqrt(vv[i]) + eps);
    }
  }
};

// ms = rho ms + (1-rho) g^2; mom = momentum mom + lr g / sqrt(ms + epsilon); var -= mom
class RmsProp : public OptimizerImpl<RmsProp> {
 public:
  using OptimizerImpl::OptimizerImpl;
  std::vector<SlotSpec> Slots() const override { return {{"rms", 1.0}, {"momentum", 0.0}}; }
  template <typename T>
  void Update(const T* v, const T* g, T* out, T** s, int64_t b, int64_t e, int64_t, double lr, T d) const {
    const T a = static_cast<T>(lr), rho = static_cast<T>(params().rho);
    const T mo = static_cast<T>(params().rms_momentum), eps = static_cast<T>(params().epsilon);
    T* ms = s[0];
    T* mom = s[1];
    for (int64_t i = b; i < e; ++i) {
      const T gi = g[i] / d;
      ms[i] = rho * ms[i] + (T(1) - rho) * gi * gi;
      mom[i] = mo * mom[i] + a * gi / std::sqrt(ms[i] + eps);
      out[i] = v[i] - mom[i];
    }
  }
};

// FTRL-proximal (TF ApplyFtrl):
//   accum_new = accum + g^2
//   linear += g - (accum_new^-p - accum^-p) / lr * var          (p = lr_power, usually -0.5)
//   quadratic = accum_new^-p / lr + 2 l2
//   var = |linear| > l1 ? (sign(linear) l1 - linear) / quadratic : 0
class Ftrl : public OptimizerImpl<Ftrl> {
 public:
  using OptimizerImpl::OptimizerImpl;
  std::vector<SlotSpec> Slots() const override { return {{"accum", params().initial_accumulator}, {"linear", 0.0}}; }
  template <typename T>
  void Update(const T* v, const T* g, T* out, T** s, int64_t b, int64_t e, int64_t, double lr, T d) const {
    const T a = static_cast<T>(lr), l1 = static_cast<T>(params().l1), l2 = static_cast<T>(params().l2);
    const T p = static_cast<T>(-params().lr_power);
    T* accum = s[0];
    T* linear = s[1];
    for (int64_t i = b; i < e; ++i) {
      const T gi = g[i] / d;
      T acc_new = accum[i] + gi * gi;
      T pow_new = std::pow(acc_new, p), pow_old = std::pow(accum[i], p);
      linear[i] += gi - (pow_new - pow_old) / a * v[i];
      T quadratic = pow_new / a + T(2) * l2;
      T lin = linear[i];
      out[i] = std::abs(lin) > l1 ? ((lin > 0 ? l1 : -l1) - lin) / quadratic : T(0);
      accum[i] = acc_new;
    }
  }
};

}  // namespace

Status OptimizerParams::Validate() const {
  static const char* kNames[] = {"sgd", "momentum", "adagrad", "adam", "rmsprop", "ftrl"};
  bool known = false;
  for (const char* n : kNames) known = known || name == n;
  if (!known) {
    return InvalidArgument("--optimizer '" + name +
                           "' is not supported (supported: sgd, momentum, adagrad, adam, "
                           "rmsprop, ftrl)");
  }
  if (!(learning_rate > 0) || !std::isfinite(learning_rate)) return InvalidArgument("--learning-rate must be > 0");
  if (!(momentum >= 0 && momentum < 1)) return InvalidArgument("--momentum must be in [0, 1)");
  if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1)) {
    return InvalidArgument("--beta1/--beta2 must be in [0, 1)");
  }
  if (!(epsilon > 0)) return InvalidArgument("--epsilon must be > 0");
  if (!(initial_accumulator > 0)) return InvalidArgument("--initial-accumulator must be > 0");
  if (!(rho >= 0 && rho < 1)) return InvalidArgument("--rho must be in [0, 1)");
  if (!(rms_momentum >= 0 && rms_momentum < 1)) return InvalidArgument("--rms-momentum must be in [0, 1)");
  if (!(l1 >= 0 && l2 >= 0)) return InvalidArgument("--l1 and --l2 must be >= 0");
  if (!(lr_power <= 0)) return InvalidArgument("--lr-power must be <= 0");
  return Status::Ok();
}

std::vector<std::string> Optimizer::SlotNames() const {
  std::vector<std::string> names;
  for (auto& s : Slots()) names.push_back(s.name);
  return names;
}

namespace {

// The slots' elements from `offset` on, as the updates take them. `listed`: the rows written
// are listed (Buffer::MarkChanged, sparse updates); else the update writes where it does not say
// (a dense range), which ends each slot's list of changes (Buffer::data()).
template <typename T>
std::array<T*, kMaxSlots> SlotPointers(std::vector<Buffer>& slots, int64_t offset, bool listed) {
  assert(slots.size() <= kMaxSlots);
  std::array<T*, kMaxSlots> at{};
  for (size_t k = 0; k < slots.size(); ++k) {
    at[k] = static_cast<T*>(listed ? slots[k].listed_data() : slots[k].data()) + offset;
  }
  return at;
}

}  // namespace

void Optimizer::Apply(const ApplyArgs& a) const {
  if (a.dtype == DType::kFloat32) {
    std::array<float*, kMaxSlots> sp = SlotPointers<float>(*a.slots, a.slot_offset, /*listed=*/false);
    Range(static_cast<const float*>(a.value), static_cast<const float*>(a.grad), static_cast<float*>(a.out), sp.data(),
          0, a.num_elements, a.step, a.learning_rate, static_cast<float>(a.grad_divisor));
  } else {
    std::array<double*, kMaxSlots> sp = SlotPointers<double>(*a.slots, a.slot_offset, /*listed=*/false);
    Range(static_cast<const double*>(a.value), static_cast<const double*>(a.grad), static_cast<double*>(a.out),
          sp.data(), 0, a.num_elements, a.step, a.learning_rate, a.grad_divisor);
  }
}

namespace {

// Rows ahead of the one updated whose first bytes are fetched: a big table's rows are far apart,
// so each would otherwise wait for memory in turn.
constexpr int64_t kPrefetchRows = 8;

template <typename T, typename Fn>
void ForEachRow(const SparseApplyArgs& a, Fn&& range) {
  const size_t slots = a.slots->size();
  const std::array<T*, kMaxSlots> base = SlotPointers<T>(*a.slots, 0, /*listed=*/true);
  std::array<T*, kMaxSlots> sp{};
  T* value = static_cast<T*>(a.value);
  const T* grad = static_cast<const T*>(a.grad);
  const uint64_t row_bytes = static_cast<uint64_t>(a.row_elements) * sizeof(T);
  auto at = [&a](int64_t n) { return a.order != nullptr ? a.order[n] : n; };
  for (int64_t n = 0; n < a.num_rows; ++n) {
    if (n + kPrefetchRows < a.num_rows) {
      const int64_t ahead = a.rows[at(n + kPrefetchRows)] * a.row_elements;
      PrefetchRow(value + ahead, row_bytes, /*for_write=*/true);
      for (size_t k = 0; k < slots; ++k) PrefetchRow(base[k] + ahead, row_bytes, /*for_write=*/true);
      if (a.grad_rows != nullptr) PrefetchRow(a.grad_rows[at(n + kPrefetchRows)], row_bytes, /*for_write=*/false);
    }
    const int64_t i = at(n);
    const int64_t off = a.rows[i] * a.row_elements;
    for (size_t k = 0; k < slots; ++k) sp[k] = base[k] + off;
    const T* g = a.grad_rows != nullptr ? static_cast<const T*>(a.grad_rows[i]) : grad + i * a.row_elements;
    // In place: each element is read before it is written.
    range(value + off, g, value + off, sp.data());
  }
}

}  // namespace

void Optimizer::ApplySparse(const SparseApplyArgs& a) const {
  ListSparseSlots(a);
  SparseApplyArgs listed = a;
  listed.slots_listed = true;
  UpdateSparse(listed);
}

void Optimizer::ListSparseSlots(const SparseApplyArgs& a) const {
  // The slot rows written are listed (replication's difference of the slots' next copy).
  const uint64_t row_bytes = static_cast<uint64_t>(a.row_elements) * DTypeSize(a.dtype);
  for (Buffer& slot : *a.slots) {
    for (int64_t n = 0; n < a.num_rows; ++n) {
      const int64_t row = a.rows[a.order != nullptr ? a.order[n] : n];
      slot.MarkChanged(static_cast<uint64_t>(row) * row_bytes, row_bytes);
    }
  }
}

void Optimizer::UpdateSparse(const SparseApplyArgs& a) const {
  assert(a.slots_listed || a.slots->empty());
  if (a.dtype == DType::kFloat32) {
    ForEachRow<float>(a, [&](const float* v, const float* g, float* o, float** s) {
      Range(v, g, o, s, 0, a.row_elements, a.step, a.learning_rate, 1.0f);  // rows arrive averaged
    });
  } else {
    ForEachRow<double>(a, [&](const double* v, const double* g, double* o, double** s) {
      Range(v, g, o, s, 0, a.row_elements, a.step, a.learning_rate, 1.0);
    });
  }
}

Result<std::unique_ptr<Optimizer>> MakeOptimizer(const OptimizerParams& p) {
  PSD_RETURN_IF_ERROR(p.Validate());
  std::unique_ptr<Optimizer> made;
  if (p.name == "sgd") {
    made.reset(new Sgd(p));
  } else if (p.name == "momentum") {
    made.reset(new Momentum(p));
  } else if (p.name == "adagrad") {
    made.reset(new Adagrad(p));
  } else if (p.name == "adam") {
    made.reset(new Adam(p));
  } else if (p.name == "rmsprop") {
    made.reset(new RmsProp(p));
  } else {
    made.reset(new Ftrl(p));
  }
  // The updates keep slot pointers in kMaxSlots places.
  if (made->Slots().size() > kMaxSlots) return Internal("optimizer '" + p.name + "' has more slots than kMaxSlots");
  return made;
}

}  // namespace psd::server
