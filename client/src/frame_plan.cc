#include "frame_plan.h"

#include <algorithm>
#include <cstdint>

namespace psclient::internal {

bool FitsOneFrame(const std::vector<uint64_t>& dense_bytes, const std::vector<uint64_t>& sparse_rows,
                  const std::vector<uint64_t>& sparse_row_bytes, uint64_t limit, uint64_t chunk_elements) {
  if (chunk_elements == 0 || limit == 0) return true;
  uint64_t total = 0;
  for (uint64_t b : dense_bytes) total += b + kFrameEntryOverhead;
  for (size_t j = 0; j < sparse_rows.size(); ++j) total += sparse_rows[j] * sparse_row_bytes[j] + kFrameEntryOverhead;
  return total <= limit;
}

std::vector<FramePlan> PlanFrames(const std::vector<uint64_t>& dense_bytes, const std::vector<uint64_t>& element_bytes,
                                  const std::vector<uint64_t>& sparse_rows,
                                  const std::vector<uint64_t>& sparse_row_bytes, uint64_t limit,
                                  uint64_t chunk_elements) {
  std::vector<FramePlan> frames(1);
  if (FitsOneFrame(dense_bytes, sparse_rows, sparse_row_bytes, limit, chunk_elements)) {
    for (size_t i = 0; i < dense_bytes.size(); ++i) frames[0].dense.push_back({i, 0, dense_bytes[i]});
    for (size_t j = 0; j < sparse_rows.size(); ++j) frames[0].sparse.push_back({j, 0, sparse_rows[j]});
    return frames;
  }
  uint64_t used = 0;  // of the last frame
  auto next_frame = [&] {
    frames.emplace_back();
    used = 0;
  };
  auto empty = [&] { return frames.back().dense.empty() && frames.back().sparse.empty(); };
  for (size_t i = 0; i < dense_bytes.size(); ++i) {
    const uint64_t bytes = dense_bytes[i], cost = bytes + kFrameEntryOverhead;
    if (cost <= limit - std::min(limit, used) || (empty() && cost <= limit)) {
      frames.back().dense.push_back({i, 0, bytes});
      used += cost;
      continue;
    }
    // A part's bytes, saturated: a product that wrapped (a daemon announcing absurd parts) could
    // be 0, and the division below with it.
    const uint64_t es = std::max<uint64_t>(1, element_bytes[i]);
    const uint64_t part = chunk_elements > UINT64_MAX / es ? UINT64_MAX : chunk_elements * es;
    uint64_t offset = 0;
    while (offset < bytes) {
      const uint64_t room = limit - std::min(limit, used + kFrameEntryOverhead);
      const uint64_t left = bytes - offset;
      uint64_t take = left <= room ? left : room / part * part;
      if (take == 0) {
        if (!empty()) {
          next_frame();
          continue;
        }
        take = std::min(left, part);  // a part over the limit: alone in its frame
      }
      frames.back().dense.push_back({i, offset, take});
      used += take + kFrameEntryOverhead;
      offset += take;
      if (offset < bytes) next_frame();
    }
  }
  for (size_t j = 0; j < sparse_rows.size(); ++j) {
    const uint64_t rows = sparse_rows[j], row_bytes = std::max<uint64_t>(1, sparse_row_bytes[j]);
    const uint64_t cost = rows * row_bytes + kFrameEntryOverhead;
    if (cost <= limit) {  // whole: here, or in a frame of its own
      if (!empty() && cost > limit - std::min(limit, used)) next_frame();
      frames.back().sparse.push_back({j, 0, rows});
      used += cost;
      continue;
    }
    uint64_t row = 0;  // bigger than a frame: runs of whole rows, the first filling the room left
    do {
      const uint64_t room = limit - std::min(limit, used + kFrameEntryOverhead);
      uint64_t take = std::min(rows - row, room / row_bytes);
      if (take == 0 && row < rows) {
        if (!empty()) {
          next_frame();
          continue;
        }
        take = 1;  // a row over the limit: alone in its frame
      }
      frames.back().sparse.push_back({j, row, row + take});
      used += take * row_bytes + kFrameEntryOverhead;
      row += take;
      if (row < rows) next_frame();
    } while (row < rows);
  }
  return frames;
}

}  // namespace psclient::internal
