// Moving tensor bytes between host memory and the caller's views, whatever memory they are in.
// Host views are plain memcpy; CUDA views use cudaMemcpy in a PSD_WITH_CUDA build and answer
// kUnimplemented otherwise, so GPU trainers compile and fail clearly on a CPU-only build.
#ifndef PSCLIENT_SRC_DEVICE_MEMORY_H_
#define PSCLIENT_SRC_DEVICE_MEMORY_H_

#include <cstddef>

#include "psd/status.h"
#include "psd/tensor.h"

namespace psclient::internal {

// dst is host memory; src lives in `kind` memory.
psd::Status CopyToHost(void* dst, const void* src, size_t bytes, psd::MemoryKind kind);
// src is host memory; dst lives in `kind` memory.
psd::Status CopyFromHost(void* dst, const void* src, size_t bytes, psd::MemoryKind kind);

}  // namespace psclient::internal

#endif  // PSCLIENT_SRC_DEVICE_MEMORY_H_
