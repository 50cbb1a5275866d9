#include "device_memory.h"

#include <cstring>

#ifdef PSD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace psclient::internal {

psd::Status CopyToHost(void* dst, const void* src, size_t bytes, psd::MemoryKind kind) {
  if (kind == psd::MemoryKind::kHost) {
    if (bytes) std::memcpy(dst, src, bytes);
    return psd::Status::Ok();
  }
#ifdef PSD_WITH_CUDA
  cudaError_t err = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return psd::Internal(std::string("cudaMemcpy: ") + cudaGetErrorString(err));
  return psd::Status::Ok();
#else
  return psd::Unimplemented("device memory needs libpsclient built with -DPSD_WITH_CUDA=ON");
#endif
}

psd::Status CopyFromHost(void* dst, const void* src, size_t bytes, psd::MemoryKind kind) {
  if (kind == psd::MemoryKind::kHost) {
    if (bytes) std::memcpy(dst, src, bytes);
    return psd::Status::Ok();
  }
#ifdef PSD_WITH_CUDA
  cudaError_t err = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
  if (err != cudaSuccess) return psd::Internal(std::string("cudaMemcpy: ") + cudaGetErrorString(err));
  return psd::Status::Ok();
#else
  return psd::Unimplemented("device memory needs libpsclient built with -DPSD_WITH_CUDA=ON");
#endif
}

}  // namespace psclient::internal
