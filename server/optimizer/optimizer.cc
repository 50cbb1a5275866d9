#include "optimizer/optimizer.h"

namespace psd::server {
namespace {

template <typename T>
void SgdKernel(const T* __restrict value, const T* __restrict grad, T* __restrict out, T lr, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = value[i] - lr * grad[i];
}

}  // namespace

void SgdOptimizer::Apply(const ApplyArgs& a) {
  if (a.dtype == DType::kFloat32) {
    SgdKernel(static_cast<const float*>(a.value), static_cast<const float*>(a.grad),
              static_cast<float*>(a.out), static_cast<float>(learning_rate()), a.num_elements);
  } else {
    SgdKernel(static_cast<const double*>(a.value), static_cast<const double*>(a.grad),
              static_cast<double*>(a.out), learning_rate(), a.num_elements);
  }
}

Result<std::unique_ptr<Optimizer>> MakeOptimizer(const std::string& name, double learning_rate) {
  if (name == "sgd") return std::unique_ptr<Optimizer>(new SgdOptimizer(learning_rate));
  return InvalidArgument("unknown optimizer '" + name + "' (supported: sgd)");
}

}  // namespace psd::server
