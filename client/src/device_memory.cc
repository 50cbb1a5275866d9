#include "device_memory.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#ifdef PSD_WITH_CUDA
#include <cuda_runtime_api.h>
#include <unistd.h>
#endif

namespace psclient::internal {

using Segment = DeviceStaging::Segment;

namespace {

// Row j of src (row_bytes each) to row rows[j] of dst.
std::vector<Segment> RowSegments(void* dst, const std::vector<size_t>& rows, const void* src, size_t row_bytes) {
  std::vector<Segment> segments;
  segments.reserve(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) {
    segments.push_back(
        {static_cast<char*>(dst) + rows[j] * row_bytes, static_cast<const char*>(src) + j * row_bytes, row_bytes});
  }
  return segments;
}

}  // namespace

#ifdef PSD_WITH_CUDA

namespace {

psd::Status CudaFailed(const std::string& what, cudaError_t err) {
  cudaGetLastError();  // clears a non-sticky error so the next call starts clean
  return psd::Internal(what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// Makes `device` current for the scope of a copy (the stream, the events and the memory must be
// on one device), and restores the caller's device after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device && cudaSetDevice(device) == cudaSuccess) switched_ = true;
  }
  ~DeviceScope() {
    if (switched_ && previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

// The device a kCuda view's pointer belongs to; InvalidArgument when it is plain host memory.
psd::Result<int> DeviceOf(const void* ptr) {
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    cudaGetLastError();
    return psd::FailedPrecondition(std::string("a view with MemoryKind::kCuda, but CUDA has no usable device here (") +
                                   cudaGetErrorString(err) + "): check the driver and CUDA_VISIBLE_DEVICES");
  }
  if (err != cudaSuccess) return CudaFailed("cudaPointerGetAttributes", err);
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged && attr.type != cudaMemoryTypeHost) {
    return psd::InvalidArgument(
        "a view with MemoryKind::kCuda points at memory CUDA does not know (plain host memory?): use "
        "MemoryKind::kHost for host memory");
  }
  return attr.device;
}

}  // namespace

struct DeviceStaging::Cuda {
  struct Buffer {
    void* host = nullptr;  // pinned (cudaHostAlloc, portable to every device)
    size_t capacity = 0;
    cudaEvent_t event = nullptr;
    int device = -1;    // the device `event` was created on
    bool busy = false;  // a copy recorded on `event` may still use `host`
  };
  Buffer buffers[kStagingChunks];
  int next = 0;

  ~Cuda() {
    Quiesce();
    for (Buffer& b : buffers) {
      if (b.event) {
        DeviceScope scope(b.device);
        cudaEventDestroy(b.event);
      }
      if (b.host) cudaFreeHost(b.host);
    }
  }

  // Waits for every copy still using a buffer (after an error, or before freeing them).
  void Quiesce() {
    for (Buffer& b : buffers) {
      if (b.busy) cudaEventSynchronize(b.event);
      b.busy = false;
    }
    cudaGetLastError();
  }

  // Buffer b, idle, on `device`, holding at least `bytes`.
  psd::Status Acquire(int b, size_t bytes, int device) {
    Buffer& buf = buffers[b];
    if (buf.busy) {
      cudaError_t err = cudaEventSynchronize(buf.event);
      buf.busy = false;
      if (err != cudaSuccess) return CudaFailed("cudaEventSynchronize", err);
    }
    if (buf.capacity < bytes) {
      // The first device copy pins every buffer at once (cudaHostAlloc may synchronize the
      // device, so it happens once per Client, not in the middle of later calls).
      for (Buffer& each : buffers) {
        if (each.host) continue;
        cudaError_t err = cudaHostAlloc(&each.host, kStagingChunkBytes, cudaHostAllocPortable);
        if (err != cudaSuccess) {
          each.host = nullptr;
          return CudaFailed("cudaHostAlloc of a " + std::to_string(kStagingChunkBytes) + "-byte staging buffer", err);
        }
        each.capacity = kStagingChunkBytes;
      }
    }
    if (buf.event == nullptr || buf.device != device) {
      if (buf.event) {
        DeviceScope scope(buf.device);
        cudaEventDestroy(buf.event);
        buf.event = nullptr;
      }
      cudaError_t err = cudaEventCreateWithFlags(&buf.event, cudaEventDisableTiming);
      if (err != cudaSuccess) {
        buf.event = nullptr;
        return CudaFailed("cudaEventCreate", err);
      }
      buf.device = device;
    }
    return psd::Status::Ok();
  }

  // One copy between pinned host memory and the device, on `stream`, waited for.
  psd::Status Direct(const std::vector<Segment>& segments, cudaStream_t stream, int device) {
    int b = next;
    next = (next + 1) % kStagingChunks;
    PSD_RETURN_IF_ERROR(Acquire(b, 0, device));
    for (const Segment& s : segments) {
      cudaError_t err = cudaMemcpyAsync(s.dst, s.src, s.bytes, cudaMemcpyDefault, stream);
      if (err != cudaSuccess) return CudaFailed("cudaMemcpyAsync (pinned)", err);
    }
    cudaError_t err = cudaEventRecord(buffers[b].event, stream);
    if (err != cudaSuccess) return CudaFailed("cudaEventRecord", err);
    err = cudaEventSynchronize(buffers[b].event);
    if (err != cudaSuccess) return CudaFailed("cudaEventSynchronize", err);
    return psd::Status::Ok();
  }

  // Device -> host, one segment (src on the device). Up to kStagingChunks chunks are in flight;
  // the oldest is drained (event waited, bytes copied out of the pinned buffer) before its buffer
  // takes the next chunk, so chunk i's memcpy runs while chunk i+1's DMA does.
  psd::Status ToHost(const Segment& s, cudaStream_t stream, int device) {
    struct InFlight {
      int buffer;
      char* dst;
      size_t bytes;
    };
    InFlight ring[kStagingChunks];
    int head = 0, count = 0;
    auto drain_one = [&]() -> psd::Status {
      InFlight& f = ring[head];
      Buffer& buf = buffers[f.buffer];
      cudaError_t err = cudaEventSynchronize(buf.event);
      buf.busy = false;
      if (err != cudaSuccess) return CudaFailed("cudaEventSynchronize", err);
      std::memcpy(f.dst, buf.host, f.bytes);
      head = (head + 1) % kStagingChunks;
      --count;
      return psd::Status::Ok();
    };
    for (size_t off = 0; off < s.bytes;) {
      size_t n = std::min(kStagingChunkBytes, s.bytes - off);
      if (count == kStagingChunks) PSD_RETURN_IF_ERROR(drain_one());
      int b = next;
      next = (next + 1) % kStagingChunks;
      PSD_RETURN_IF_ERROR(Acquire(b, n, device));
      Buffer& buf = buffers[b];
      cudaError_t err = cudaMemcpyAsync(buf.host, s.src + off, n, cudaMemcpyDefault, stream);
      if (err != cudaSuccess) return CudaFailed("cudaMemcpyAsync (device to host)", err);
      err = cudaEventRecord(buf.event, stream);
      if (err != cudaSuccess) return CudaFailed("cudaEventRecord", err);
      buf.busy = true;
      ring[(head + count) % kStagingChunks] = {b, s.dst + off, n};
      ++count;
      off += n;
    }
    while (count > 0) PSD_RETURN_IF_ERROR(drain_one());
    return psd::Status::Ok();
  }

  // Host -> device, any number of segments (dst on the device) packed into the staging buffers:
  // filling buffer i+1 (a host memcpy) overlaps the DMA out of buffer i. Returns once the last
  // chunk's event (and so, in stream order, every chunk) has completed.
  psd::Status FromHost(const std::vector<Segment>& segments, cudaStream_t stream, int device) {
    size_t total = 0;
    for (const Segment& s : segments) total += s.bytes;
    if (total == 0) return psd::Status::Ok();
    int b = -1;
    size_t fill = 0, cap = 0, left = total;
    auto seal = [&]() -> psd::Status {  // the current buffer's copies are all queued
      cudaError_t err = cudaEventRecord(buffers[b].event, stream);
      if (err != cudaSuccess) return CudaFailed("cudaEventRecord", err);
      buffers[b].busy = true;
      return psd::Status::Ok();
    };
    for (const Segment& s : segments) {
      for (size_t off = 0; off < s.bytes;) {
        if (b < 0 || fill == cap) {
          if (b >= 0) PSD_RETURN_IF_ERROR(seal());
          b = next;
          next = (next + 1) % kStagingChunks;
          cap = std::min(kStagingChunkBytes, left);
          PSD_RETURN_IF_ERROR(Acquire(b, cap, device));
          fill = 0;
        }
        size_t n = std::min(s.bytes - off, cap - fill);
        char* staged = static_cast<char*>(buffers[b].host) + fill;
        std::memcpy(staged, s.src + off, n);
        cudaError_t err = cudaMemcpyAsync(s.dst + off, staged, n, cudaMemcpyDefault, stream);
        if (err != cudaSuccess) return CudaFailed("cudaMemcpyAsync (host to device)", err);
        fill += n;
        off += n;
        left -= n;
      }
    }
    PSD_RETURN_IF_ERROR(seal());
    cudaError_t err = cudaEventSynchronize(buffers[b].event);
    if (err != cudaSuccess) return CudaFailed("cudaEventSynchronize", err);
    for (Buffer& buf : buffers) buf.busy = false;  // recorded earlier on the same stream: done
    return psd::Status::Ok();
  }
};

DeviceStaging::DeviceStaging() = default;
DeviceStaging::~DeviceStaging() {
  cuda_.reset();  // every copy done
  for (const PinnedRanges::Range& r : pinned_.ranges()) cudaHostUnregister(reinterpret_cast<void*>(r.base));
}

psd::Status DeviceStaging::PinHost(void* p, size_t bytes) {
  // The twins are 64-byte-aligned blocks of the shared buffers, so two may share a page, which
  // CUDA pins once: the pages not pinned yet are pinned, in pieces between those pinned before.
  const auto page_size = ::sysconf(_SC_PAGESIZE);
  const size_t page = page_size > 0 ? static_cast<size_t>(page_size) : 4096;
  for (const PinnedRanges::Range& r : pinned_.Missing(p, bytes, page)) {
    cudaError_t err = cudaHostRegister(reinterpret_cast<void*>(r.base), r.bytes, cudaHostRegisterPortable);
    if (err != cudaSuccess) return CudaFailed("cudaHostRegister of " + std::to_string(r.bytes) + " bytes", err);
    pinned_.Add(r);
  }
  return psd::Status::Ok();
}

size_t DeviceStaging::pinned_bytes() const {
  size_t n = 0;
  if (cuda_) {
    for (const auto& b : cuda_->buffers) n += b.capacity;
  }
  return n;
}

psd::Status DeviceStaging::OnDevice(const void* ptr, const std::function<psd::Status(Cuda&, int)>& copy) {
  auto device = DeviceOf(ptr);
  if (!device.ok()) return device.status();
  DeviceScope scope(*device);
  if (!cuda_) cuda_ = std::make_unique<Cuda>();
  psd::Status st = copy(*cuda_, *device);
  if (!st.ok()) cuda_->Quiesce();
  return st;
}

psd::Status DeviceStaging::DeviceToHost(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return psd::Status::Ok();
  Segment s{static_cast<char*>(dst), static_cast<const char*>(src), bytes};
  std::vector<Segment> direct;
  const bool pinned = SplitPinned({s}, /*host_is_dst=*/true, &direct);
  return OnDevice(src, [&](Cuda& cuda, int device) {
    return pinned ? cuda.Direct(direct, static_cast<cudaStream_t>(stream), device)
                  : cuda.ToHost(s, static_cast<cudaStream_t>(stream), device);
  });
}

psd::Status DeviceStaging::HostToDevice(const std::vector<Segment>& segments, void* stream) {
  if (segments.empty()) return psd::Status::Ok();
  std::vector<Segment> direct;
  const bool pinned = SplitPinned(segments, /*host_is_dst=*/false, &direct);
  return OnDevice(segments.front().dst, [&](Cuda& cuda, int device) {
    return pinned ? cuda.Direct(direct, static_cast<cudaStream_t>(stream), device)
                  : cuda.FromHost(segments, static_cast<cudaStream_t>(stream), device);
  });
}

#else  // !PSD_WITH_CUDA

struct DeviceStaging::Cuda {};

DeviceStaging::DeviceStaging() = default;
DeviceStaging::~DeviceStaging() = default;

size_t DeviceStaging::pinned_bytes() const { return 0; }

namespace {
psd::Status NoCuda() {
  return psd::Unimplemented(
      "a view with MemoryKind::kCuda needs libpsclient built with -DPSD_WITH_CUDA=ON (this one is CPU-only); "
      "copy the tensor to host memory or rebuild (README \"GPU trainers\")");
}
}  // namespace

psd::Status DeviceStaging::DeviceToHost(void*, const void*, size_t, void*) { return NoCuda(); }

psd::Status DeviceStaging::PinHost(void*, size_t) { return NoCuda(); }

psd::Status DeviceStaging::HostToDevice(const std::vector<Segment>&, void*) { return NoCuda(); }

#endif  // PSD_WITH_CUDA

bool DeviceStaging::SplitPinned(const std::vector<Segment>& segments, bool host_is_dst,
                                std::vector<Segment>* out) const {
  out->clear();
  std::vector<PinnedRanges::Range> pieces;
  for (const Segment& s : segments) {
    if (!pinned_.Pieces(host_is_dst ? s.dst : s.src, s.bytes, &pieces)) return false;
    for (const PinnedRanges::Range& piece : pieces)
      out->push_back({s.dst + piece.base, s.src + piece.base, piece.bytes});
  }
  return true;
}

psd::Status DeviceStaging::ToHost(void* dst, const void* src, size_t bytes, psd::MemoryKind kind, void* stream) {
  if (kind != psd::MemoryKind::kHost) return DeviceToHost(dst, src, bytes, stream);
  if (bytes) std::memcpy(dst, src, bytes);
  return psd::Status::Ok();
}

psd::Status DeviceStaging::FromHost(void* dst, const void* src, size_t bytes, psd::MemoryKind kind, void* stream) {
  if (kind != psd::MemoryKind::kHost) {
    if (bytes == 0) return HostToDevice({}, stream);
    return HostToDevice({{static_cast<char*>(dst), static_cast<const char*>(src), bytes}}, stream);
  }
  if (bytes) std::memcpy(dst, src, bytes);
  return psd::Status::Ok();
}

psd::Status DeviceStaging::RowsFromHost(void* dst, const std::vector<size_t>& rows, const void* src, size_t row_bytes,
                                        psd::MemoryKind kind, void* stream) {
  if (kind != psd::MemoryKind::kHost) {
    return HostToDevice(row_bytes ? RowSegments(dst, rows, src, row_bytes) : std::vector<Segment>{}, stream);
  }
  for (size_t j = 0; j < rows.size() && row_bytes; ++j) {
    std::memcpy(static_cast<char*>(dst) + rows[j] * row_bytes, static_cast<const char*>(src) + j * row_bytes,
                row_bytes);
  }
  return psd::Status::Ok();
}

}  // namespace psclient::internal
