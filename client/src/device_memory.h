// Moving tensor bytes between host memory and the caller's views, whatever memory they are in.
//
// Host views are plain memcpy. CUDA views (a PSD_WITH_CUDA build) go through pinned staging
// buffers that the DeviceStaging owns and reuses across calls (kStagingChunks buffers of
// kStagingChunkBytes, pinned at the first device copy, freed with it): the bytes move in chunks of
// kStagingChunkBytes with cudaMemcpyAsync on the view's stream (nullptr: the default stream), one
// cudaEvent per staging buffer, and up to kStagingChunks chunks in flight, so the DMA of one
// chunk overlaps the host-side memcpy of the previous one. A copy waits only on events it
// recorded on the caller's stream (cudaEventSynchronize): it runs after the work already queued
// on that stream and never waits for other streams (no cudaDeviceSynchronize). A build without
// PSD_WITH_CUDA answers kUnimplemented for CUDA views, so GPU trainers compile and fail clearly.
// Host memory pinned with PinHost (the client's host twins of device views, README "GPU
// trainers") skips the staging buffers: one cudaMemcpyAsync per registration the copy's host
// side lies in (pinned_ranges.h), waited on its event.
//
// Thread-safety: none; a Client's calls are serialized by its mutex, and each Client owns one.
// Every copy has finished (device memory written, or host memory filled) when the call returns.
#ifndef PSCLIENT_SRC_DEVICE_MEMORY_H_
#define PSCLIENT_SRC_DEVICE_MEMORY_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "pinned_ranges.h"
#include "psd/status.h"
#include "psd/tensor.h"

namespace psclient::internal {

// The size of one pinned staging buffer, and how many of them a DeviceStaging keeps at most
// (so at most kStagingChunks * kStagingChunkBytes of pinned memory per Client).
constexpr size_t kStagingChunkBytes = size_t{4} << 20;  // 4 MiB
constexpr int kStagingChunks = 3;

class DeviceStaging {
 public:
  DeviceStaging();
  ~DeviceStaging();  // frees the pinned buffers and the events
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  // dst is host memory; src lives in `kind` memory (stream: a cudaStream_t for kCuda).
  psd::Status ToHost(void* dst, const void* src, size_t bytes, psd::MemoryKind kind, void* stream);
  // src is host memory; dst lives in `kind` memory.
  psd::Status FromHost(void* dst, const void* src, size_t bytes, psd::MemoryKind kind, void* stream);
  // Rows: for every j, row_bytes from src + j * row_bytes to dst + rows[j] * row_bytes (dst in
  // `kind` memory); the rows share staging chunks, so many small rows cost few waits.
  psd::Status RowsFromHost(void* dst, const std::vector<size_t>& rows, const void* src, size_t row_bytes,
                           psd::MemoryKind kind, void* stream);

  // One contiguous piece of a copy between host memory and device memory.
  struct Segment {
    char* dst;
    const char* src;
    size_t bytes;
  };

  // Pinned bytes held now (0 until a CUDA view has been copied, then kStagingChunks * kStagingChunkBytes).
  size_t pinned_bytes() const;

  // Pins `bytes` of host memory at `p` for DMA (cudaHostRegister) until this DeviceStaging goes:
  // a copy whose host side lies in it moves with no staging, in one cudaMemcpyAsync per
  // registration it touches (pinned_ranges.h). The memory must stay mapped until then.
  // UNIMPLEMENTED in a CPU-only build.
  psd::Status PinHost(void* p, size_t bytes);

 private:
  struct Cuda;  // CUDA state (PSD_WITH_CUDA builds)
  // The device side of the copies above (a CPU-only build: UNIMPLEMENTED).
  psd::Status DeviceToHost(void* dst, const void* src, size_t bytes, void* stream);
  psd::Status HostToDevice(const std::vector<Segment>& segments, void* stream);
  // Runs `copy` with the device that owns `ptr` current; waits out what it left in flight on error.
  psd::Status OnDevice(const void* ptr, const std::function<psd::Status(Cuda&, int device)>& copy);

  // Whether every segment's host side (dst or src) lies in memory PinHost pinned; if so, `out`
  // gets them split so that each piece's host side lies in one registration.
  bool SplitPinned(const std::vector<Segment>& segments, bool host_is_dst, std::vector<Segment>* out) const;

  std::unique_ptr<Cuda> cuda_;  // created on the first CUDA copy
  PinnedRanges pinned_;         // PinHost's registrations
};

}  // namespace psclient::internal

#endif  // PSCLIENT_SRC_DEVICE_MEMORY_H_
