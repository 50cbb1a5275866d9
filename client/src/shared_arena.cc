#include "shared_arena.h"

#include <algorithm>
#include <string>
#include <utility>

namespace psclient::internal {

psd::Result<std::shared_ptr<SharedArena>> SharedArena::Create(uint64_t bytes) {
  auto segment = psd::wire::SharedSegment::Create(
      std::max<uint64_t>(psd::wire::ShmAlign(bytes), psd::wire::SharedSegment::kMinBytes), "psclient-buffers");
  if (!segment.ok()) return segment.status();
  return std::shared_ptr<SharedArena>(new SharedArena(
      std::move(*segment),
      "ClientOptions::shared_buffer_bytes: free some SharedBuffers, or raise it and psd's --shm-max-bytes",
      /*punch_from=*/0));
}

}  // namespace psclient::internal
