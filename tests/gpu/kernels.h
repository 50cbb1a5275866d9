// The GPU test's kernels (kernels.cu): a linear-regression gradient, an embedding gradient, and a
// kernel that keeps another stream busy until the host says stop.
#ifndef PSD_TESTS_GPU_KERNELS_H_
#define PSD_TESTS_GPU_KERNELS_H_

#include <cuda_runtime_api.h>

namespace psd_gpu_test {

// residual[b] = x[b, :] . w - y[b] for b < batch (x is batch x d, row-major); then
// grad[j] = sum_b x[b, j] * residual[b] / batch. Fixed reduction order: the same inputs give the
// same bits on every run.
cudaError_t LinearRegressionGradient(const float* x, const float* y, const float* w, int batch, int d, float* residual,
                                     float* grad, cudaStream_t stream);
// grad[i] = rows[i] - target, n elements.
cudaError_t EmbeddingGradient(const float* rows, float target, int n, float* grad, cudaStream_t stream);
// Spins until *stop != 0 (then *result = 1) or budget_ns of GPU time pass (then *result = 2).
// stop and result are mapped pinned host memory.
cudaError_t Spin(const volatile int* stop, unsigned long long budget_ns, volatile int* result, cudaStream_t stream);

}  // namespace psd_gpu_test

#endif  // PSD_TESTS_GPU_KERNELS_H_
