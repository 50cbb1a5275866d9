// How a push is cut into frames: one frame when it fits, else several of at most `limit` bytes,
// dense gradients bigger than the room left cut into chunks of whole parts (the daemon's
// HelloReply.chunkElements), so a push of any size travels and the daemon holds one frame per
// connection at a time, never the whole push.
#ifndef PSCLIENT_SRC_PUSH_FRAMES_H_
#define PSCLIENT_SRC_PUSH_FRAMES_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace psclient::internal {

// Bytes `offset`..`offset + bytes` of dense gradient `entry` (the whole one when bytes is all of it).
struct PushPiece {
  size_t entry;
  uint64_t offset;
  uint64_t bytes;
};

struct PushFrame {
  std::vector<PushPiece> dense;
  std::vector<size_t> sparse;  // sparse gradients travel whole
};

// The overhead a frame's entry costs besides its data (name, shape, list pointers): counted
// against `limit` so a planned frame stays under it.
inline constexpr uint64_t kPushEntryOverhead = 512;

// `dense_bytes[i]`, `element_bytes[i]`: gradient i's size and its dtype's element size.
// `chunk_elements` 0 (a daemon that takes no chunks) or `limit` 0: one frame with everything. A
// chunk holds whole parts (a multiple of chunk_elements elements, the last one ends the gradient);
// a part bigger than `limit` still travels alone (the daemon's --max-frame-bytes check then says
// what to raise). Frames are filled in order: a gradient that does not fit the room left starts a
// new frame, or, bigger than a frame, is cut so that its first chunk fills the room left.
std::vector<PushFrame> PlanPushFrames(const std::vector<uint64_t>& dense_bytes,
                                      const std::vector<uint64_t>& element_bytes,
                                      const std::vector<uint64_t>& sparse_bytes, uint64_t limit,
                                      uint64_t chunk_elements);

}  // namespace psclient::internal

#endif  // PSCLIENT_SRC_PUSH_FRAMES_H_
