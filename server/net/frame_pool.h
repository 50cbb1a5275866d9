// FramePool: where the daemon's connections get the body buffers of big incoming frames, and where
// those buffers go back to, bounded by --max-inflight-bytes.
//
// Why not the heap: glibc serves a buffer below its mmap threshold (32 MiB, psd::TuneAllocator)
// from the arena of the I/O thread that asked, and keeps what is freed there for that arena. With
// many connections read by several I/O threads, each arena ends up keeping its own share of the
// frames once in flight, so the frames' memory after a burst is a multiple of what the budget lets
// be in flight at once (64 workers pushing over TCP: 60 MiB more than the budget's 32 MiB).
//
// Buffers of kMinBytes and up are mapped from the kernel (rounded up to kGranule) and given back to
// this pool when a connection is done with them. The pool keeps what it is given back while the
// buffers handed out and the ones kept together stay within `limit` (the frame budget's limit: the
// connections hold at most that much at once, but for one frame read alone); beyond that it unmaps
// them. So frame memory stays within the limit plus one oversized frame, whatever the number of
// connections and threads, and steady pushes reuse mapped pages (no page faults per frame).
// Smaller buffers come from the heap.
//
// Thread-safety: Take and the buffers' disposal may run on any thread (one mutex). The pool must
// outlive every buffer it handed out (the connections holding them).
#ifndef PSD_SERVER_NET_FRAME_POOL_H_
#define PSD_SERVER_NET_FRAME_POOL_H_

#include <cstdint>
#include <map>

#include "base/mutex.h"
#include "wire/frame.h"

namespace psd::server {

class FramePool final : public wire::BufferSource, private kj::ArrayDisposer {
 public:
  static constexpr uint64_t kMinBytes = 64 << 10;
  static constexpr uint64_t kGranule = 64 << 10;

  explicit FramePool(uint64_t limit_bytes) : limit_(limit_bytes) {}
  ~FramePool() override;
  FramePool(const FramePool&) = delete;
  FramePool& operator=(const FramePool&) = delete;

  kj::Array<capnp::word> Take(uint64_t words) override EXCLUDES(mu_);

  uint64_t limit() const { return limit_; }
  uint64_t handed_out_bytes() const EXCLUDES(mu_);  // buffers of kMinBytes and up held by connections
  uint64_t kept_bytes() const EXCLUDES(mu_);        // given back and kept for the next frames
  uint64_t maps() const EXCLUDES(mu_);              // buffers mapped from the kernel so far
  uint64_t reuses() const EXCLUDES(mu_);            // buffers handed out again from the pool

 private:
  void disposeImpl(void* first, size_t element_size, size_t element_count, size_t capacity,
                   void (*destroy_element)(void*)) const override EXCLUDES(mu_);

  const uint64_t limit_;
  // disposeImpl is const (kj's interface): the state it changes is mutable.
  mutable Mutex mu_;
  mutable std::multimap<uint64_t, void*> kept_ GUARDED_BY(mu_);  // bytes -> mapping
  mutable uint64_t kept_bytes_ GUARDED_BY(mu_) = 0;
  mutable uint64_t handed_out_ GUARDED_BY(mu_) = 0;
  mutable uint64_t maps_ GUARDED_BY(mu_) = 0;
  mutable uint64_t reuses_ GUARDED_BY(mu_) = 0;
};

}  // namespace psd::server

#endif  // PSD_SERVER_NET_FRAME_POOL_H_
