#include "service/values_segment.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <mutex>

namespace psd::server {

namespace {

std::atomic<ValuesSegment*> the_segment{nullptr};

}  // namespace

Result<ValuesSegment*> ValuesSegment::Open(uint64_t bytes) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (ValuesSegment* made = the_segment.load()) return made;
  // Workers map it read-only, and nothing they do makes it writable (a worker of psd's uid can
  // change the memfd's mode): sealed F_SEAL_FUTURE_WRITE. So freed blocks keep their pages for the
  // next buffer there (they cannot be punched out), as big heap buffers are kept for reuse.
  auto arena = wire::SharedArena::CreateWrittenHereOnly(bytes, "psd-values", "--max-model-bytes sizes it");
  if (!arena.ok()) return arena.status();
  auto fd = (*arena)->segment().ReadOnlyDescriptor();
  if (!fd.ok()) return fd.status();
  auto* made = new ValuesSegment(std::move(*arena), *fd);  // never freed: buffers may outlive daemons
  SetBufferStorage(made);
  the_segment.store(made);
  return made;
}

ValuesSegment* ValuesSegment::Current() { return the_segment.load(std::memory_order_acquire); }

void* ValuesSegment::Allocate(size_t bytes) {
  auto at = arena_->Allocate(bytes);
  if (!at.ok()) return nullptr;  // full: this buffer goes to the heap
  return arena_->At(*at, bytes);
}

bool ValuesSegment::Free(void* p, size_t bytes) {
  const int64_t at = arena_->OffsetOf(p, bytes);
  if (at < 0) return false;
  arena_->Free(static_cast<uint64_t>(at));
  return true;
}

}  // namespace psd::server
