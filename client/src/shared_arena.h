// The arena behind psclient::SharedBuffer (Client::AllocateShared): one memfd per Client, mapped
// here and, by every same-host daemon the client talks to, as the connection's segment 1
// (Tensor.shmSegment). A gradient pushed from it is read by psd in place, and values pulled into
// it are written by psd in place: no copy on either side. Blocks are handed out first-fit, at
// multiples of 64 bytes, and freed when their SharedBuffer goes (the arena lives as long as the
// last of them or the Client).
#ifndef PSCLIENT_SRC_SHARED_ARENA_H_
#define PSCLIENT_SRC_SHARED_ARENA_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "psd/status.h"
#include "wire/shm.h"

namespace psclient::internal {

class SharedArena {
 public:
  // An arena of `bytes` (virtual: pages are used only as touched).
  static psd::Result<std::shared_ptr<SharedArena>> Create(uint64_t bytes);

  // The offset of a new block of `bytes` (rounded up to 64; its bytes read as zeros), or
  // RESOURCE_EXHAUSTED naming ClientOptions::shared_buffer_bytes.
  psd::Result<uint64_t> Allocate(uint64_t bytes);
  // Gives back the block at `offset` (from Allocate), and its pages to the system.
  void Free(uint64_t offset);

  // The offset of [p, p + bytes) when it lies inside the arena, else -1.
  int64_t OffsetOf(const void* p, uint64_t bytes) const;
  // [offset, offset + bytes) of the arena, or nullptr.
  uint8_t* At(uint64_t offset, uint64_t bytes) const { return segment_->At(offset, bytes); }
  uint8_t* data() const { return segment_->data(); }
  uint64_t size() const { return segment_->size(); }
  int fd() const { return segment_->fd(); }

 private:
  explicit SharedArena(std::shared_ptr<psd::wire::SharedSegment> segment);

  const std::shared_ptr<psd::wire::SharedSegment> segment_;
  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;  // offset -> bytes, coalesced
  std::map<uint64_t, uint64_t> used_;  // offset -> bytes
};

}  // namespace psclient::internal

#endif  // PSCLIENT_SRC_SHARED_ARENA_H_
