// ValuesSegment: the daemon's values segment (README "Same-host shared memory", *Values in
// place*). psd keeps its big buffers (server/core/buffer.h: kSharedStorageMinBytes and up) in one
// memfd, and sends same-host workers a read-only descriptor of it when their segment attaches
// (ShmListener). A pull into shared memory then names where the value psd published lies
// (Tensor.shmSegment = 2) instead of psd writing it into the worker's segment: each worker copies
// it straight into its own tensors, and psd writes nothing per worker. The reply's buffer is held
// for that connection (WorkerSession) until a later request of it says it has read it
// (Request.valuesRead): the engine never writes a buffer somebody holds (it takes another).
//
// One per process (the first daemon's size; tests run several daemons in one process), created
// at the first daemon that offers shared memory and never freed: buffers may outlive daemons.
#ifndef PSD_SERVER_SERVICE_VALUES_SEGMENT_H_
#define PSD_SERVER_SERVICE_VALUES_SEGMENT_H_

#include <cstdint>
#include <memory>

#include "core/buffer.h"
#include "psd/status.h"
#include "wire/shared_arena.h"

namespace psd::server {

class ValuesSegment : public BufferStorage {
 public:
  // The process's values segment, made now (`bytes` of virtual memory: pages are used only as
  // buffers touch them) unless one was, and set as the big buffers' storage; or why not (then
  // buffers stay in the heap and values are written into the workers' segments).
  static Result<ValuesSegment*> Open(uint64_t bytes);
  // The one made by Open, or null.
  static ValuesSegment* Current();

  void* Allocate(size_t bytes) override;
  bool Free(void* p, size_t bytes) override;

  // The offset of [p, p + bytes) in the segment, or -1 (a buffer in the heap).
  int64_t OffsetOf(const void* p, uint64_t bytes) const { return arena_->OffsetOf(p, bytes); }
  // A read-only descriptor of it (owned here): what workers are sent.
  int read_only_fd() const { return read_only_fd_; }
  uint64_t size() const { return arena_->size(); }
  uint64_t in_use() const { return arena_->in_use(); }

 private:
  ValuesSegment(std::shared_ptr<wire::SharedArena> arena, int read_only_fd)
      : arena_(std::move(arena)), read_only_fd_(read_only_fd) {}

  const std::shared_ptr<wire::SharedArena> arena_;
  const int read_only_fd_;
};

}  // namespace psd::server

#endif  // PSD_SERVER_SERVICE_VALUES_SEGMENT_H_
