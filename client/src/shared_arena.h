// The arena behind psclient::SharedBuffer (Client::AllocateShared): one memfd per Client, mapped
// here and, by every same-host daemon the client talks to, as the connection's segment 1
// (Tensor.shmSegment). A gradient pushed from it is read by psd in place, and values pulled into
// it are written by psd in place: no copy on either side. A freed block's pages go back to the
// system (its bytes read as zeros when handed out again); the arena lives as long as the last
// SharedBuffer or the Client. The blocks: psd::wire::SharedArena.
#ifndef PSCLIENT_SRC_SHARED_ARENA_H_
#define PSCLIENT_SRC_SHARED_ARENA_H_

#include <cstdint>
#include <memory>

#include "wire/shared_arena.h"

namespace psclient::internal {

class SharedArena : public psd::wire::SharedArena {
 public:
  // An arena of `bytes`; a full one says to free SharedBuffers or raise
  // ClientOptions::shared_buffer_bytes.
  static psd::Result<std::shared_ptr<SharedArena>> Create(uint64_t bytes);

 private:
  using psd::wire::SharedArena::SharedArena;
};

}  // namespace psclient::internal

#endif  // PSCLIENT_SRC_SHARED_ARENA_H_
