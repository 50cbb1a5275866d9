// How a request is cut into frames: one frame when it fits, else several of at most `limit`
// bytes, dense tensors bigger than the room left cut into chunks of whole parts (the daemon's
// HelloReply.chunkElements). A push of any size travels and the daemon holds one frame per
// connection at a time, never the whole push; a pull asks for ranges that each reply in one
// frame, so the client holds one frame, never the whole model.
#ifndef PSCLIENT_SRC_FRAME_PLAN_H_
#define PSCLIENT_SRC_FRAME_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace psclient::internal {

// Bytes `offset`..`offset + bytes` of dense tensor `entry` (the whole one when bytes is all of it).
struct FramePiece {
  size_t entry;
  uint64_t offset;
  uint64_t bytes;
};

// Rows [row_begin, row_end) of sparse gradient `entry` (after coalescing: sorted, unique).
struct SparsePiece {
  size_t entry;
  uint64_t row_begin;
  uint64_t row_end;
};

struct FramePlan {
  std::vector<FramePiece> dense;
  std::vector<SparsePiece> sparse;  // pulls: none
};

// The overhead a frame's entry costs besides its data (name, shape, list pointers): counted
// against `limit` so a planned frame stays under it.
inline constexpr uint64_t kFrameEntryOverhead = 512;

// Whether dense tensors of `dense_bytes` and sparse ones of `sparse_rows` x `sparse_row_bytes` go
// in one frame (PlanFrames then plans exactly that): they fit `limit`, or nothing is cut.
bool FitsOneFrame(const std::vector<uint64_t>& dense_bytes, const std::vector<uint64_t>& sparse_rows,
                  const std::vector<uint64_t>& sparse_row_bytes, uint64_t limit, uint64_t chunk_elements);

// `dense_bytes[i]`, `element_bytes[i]`: gradient i's size and its dtype's element size;
// `sparse_rows[j]`, `sparse_row_bytes[j]`: sparse gradient j's rows and the bytes of one (its
// values and its index). `chunk_elements` 0 (a daemon that takes no chunks) or `limit` 0: one
// frame with everything. A chunk holds whole parts (a multiple of chunk_elements elements, the
// last one ends the gradient); a sparse gradient bigger than the room left is cut into runs of
// whole rows (Gradient.rowsMore on all but the last); a part or a row bigger than `limit` still
// travels alone (the daemon's --max-frame-bytes check then says what to raise). Frames are filled
// in order: a gradient that does not fit the room left starts a new frame, or, bigger than a
// frame, is cut so that its first chunk fills the room left.
std::vector<FramePlan> PlanFrames(const std::vector<uint64_t>& dense_bytes, const std::vector<uint64_t>& element_bytes,
                                  const std::vector<uint64_t>& sparse_rows,
                                  const std::vector<uint64_t>& sparse_row_bytes, uint64_t limit,
                                  uint64_t chunk_elements);

}  // namespace psclient::internal

#endif  // PSCLIENT_SRC_FRAME_PLAN_H_
