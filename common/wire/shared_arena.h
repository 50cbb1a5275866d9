// SharedArena: blocks of one shared-memory segment (a memfd: wire/shm.h), handed out first-fit at
// multiples of 64 bytes, named by their offset so that another process mapping the same segment
// finds them. Two users:
// - the client's shared buffers (psclient::Client::AllocateShared; a connection's segment 1): a
//   daemon on the host adds gradients from them and writes values into them in place;
// - the daemon's values segment (segment 2): psd keeps its big buffers there (server/core/
//   buffer.h), and same-host workers map it read-only and copy the values they pull straight from
//   the buffer psd published (README "Same-host shared memory").
// Thread-safe.
#ifndef PSD_WIRE_SHARED_ARENA_H_
#define PSD_WIRE_SHARED_ARENA_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "psd/status.h"
#include "wire/shm.h"

namespace psd::wire {

class SharedArena {
 public:
  // An arena of `bytes` (virtual: pages are used only as touched) in a memfd named `name`.
  // `exhausted`: what a RESOURCE_EXHAUSTED from Allocate tells the caller to do. A freed block of
  // `punch_from` bytes or more gives its pages back to the system (they read as zeros when handed
  // out again); smaller ones keep theirs for the next block there (0: every block gives them back).
  static Result<std::shared_ptr<SharedArena>> Create(uint64_t bytes, const std::string& name, std::string exhausted,
                                                     uint64_t punch_from = 0);
  // An arena that only this process writes, whoever else maps it (SharedSegment::Create's
  // `written_here_only`): its freed blocks keep their pages (they cannot be punched out).
  static Result<std::shared_ptr<SharedArena>> CreateWrittenHereOnly(uint64_t bytes, const std::string& name,
                                                                    std::string exhausted);
  virtual ~SharedArena() = default;
  SharedArena(const SharedArena&) = delete;
  SharedArena& operator=(const SharedArena&) = delete;

  // The offset of a new block of `bytes` (rounded up to 64), or RESOURCE_EXHAUSTED.
  Result<uint64_t> Allocate(uint64_t bytes);
  // Gives back the block at `offset` (from Allocate).
  void Free(uint64_t offset);

  // The offset of [p, p + bytes) when it lies inside the arena, else -1.
  int64_t OffsetOf(const void* p, uint64_t bytes) const;
  // [offset, offset + bytes) of the arena, or nullptr.
  uint8_t* At(uint64_t offset, uint64_t bytes) const { return segment_->At(offset, bytes); }
  uint8_t* data() const { return segment_->data(); }
  uint64_t size() const { return segment_->size(); }
  int fd() const { return segment_->fd(); }
  const SharedSegment& segment() const { return *segment_; }
  // Bytes in blocks handed out now.
  uint64_t in_use() const;

 protected:
  SharedArena(std::shared_ptr<SharedSegment> segment, std::string exhausted, uint64_t punch_from);

 private:
  const std::shared_ptr<SharedSegment> segment_;
  const std::string exhausted_;
  const uint64_t punch_from_;
  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;  // offset -> bytes, coalesced
  std::map<uint64_t, uint64_t> used_;  // offset -> bytes
  uint64_t in_use_ = 0;
};

}  // namespace psd::wire

#endif  // PSD_WIRE_SHARED_ARENA_H_
