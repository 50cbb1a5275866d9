#include "kernels.h"

namespace psd_gpu_test {
namespace {

constexpr int kThreads = 256;

__global__ void ResidualKernel(const float* x, const float* y, const float* w, int d, float* residual) {
  __shared__ float partial[kThreads];
  const int b = blockIdx.x;
  float sum = 0;
  for (int j = threadIdx.x; j < d; j += kThreads) sum += x[static_cast<size_t>(b) * d + j] * w[j];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) residual[b] = partial[0] - y[b];
}

__global__ void GradientKernel(const float* x, const float* residual, int batch, int d, float* grad) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= d) return;
  float g = 0;
  for (int b = 0; b < batch; ++b) g += x[static_cast<size_t>(b) * d + j] * residual[b];
  grad[j] = g / static_cast<float>(batch);
}

__global__ void EmbeddingKernel(const float* rows, float target, int n, float* grad) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) grad[i] = rows[i] - target;
}

__device__ unsigned long long GlobalTimerNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinKernel(const volatile int* stop, unsigned long long budget_ns, volatile int* result) {
  unsigned long long start = GlobalTimerNs();
  while (*stop == 0) {
    if (GlobalTimerNs() - start > budget_ns) {
      *result = 2;
      return;
    }
  }
  *result = 1;
}

}  // namespace

cudaError_t LinearRegressionGradient(const float* x, const float* y, const float* w, int batch, int d, float* residual,
                                     float* grad, cudaStream_t stream) {
  ResidualKernel<<<batch, kThreads, 0, stream>>>(x, y, w, d, residual);
  GradientKernel<<<(d + kThreads - 1) / kThreads, kThreads, 0, stream>>>(x, residual, batch, d, grad);
  return cudaGetLastError();
}

cudaError_t EmbeddingGradient(const float* rows, float target, int n, float* grad, cudaStream_t stream) {
  EmbeddingKernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(rows, target, n, grad);
  return cudaGetLastError();
}

cudaError_t Spin(const volatile int* stop, unsigned long long budget_ns, volatile int* result, cudaStream_t stream) {
  SpinKernel<<<1, 1, 0, stream>>>(stop, budget_ns, result);
  return cudaGetLastError();
}

}  // namespace psd_gpu_test
