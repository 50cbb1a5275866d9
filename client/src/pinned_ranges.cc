#include "pinned_ranges.h"

#include <algorithm>

namespace psclient::internal {

const PinnedRanges::Range* PinnedRanges::Holding(uintptr_t at) const {
  for (const Range& r : ranges_) {
    if (at >= r.base && at - r.base < r.bytes) return &r;
  }
  return nullptr;
}

std::vector<PinnedRanges::Range> PinnedRanges::Missing(const void* p, size_t bytes, size_t page) const {
  std::vector<Range> out;
  if (bytes == 0 || page == 0) return out;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
  for (uintptr_t at = lo; at < hi;) {
    if (const Range* r = Holding(at)) {
      at = r->base + r->bytes;  // pinned already
      continue;
    }
    uintptr_t end = hi;  // up to the next pinned range's start, or the end
    for (const Range& r : ranges_) {
      if (r.base > at && r.base < end) end = r.base;
    }
    out.push_back({at, end - at});
    at = end;
  }
  return out;
}

bool PinnedRanges::Pieces(const void* p, size_t bytes, std::vector<Range>* pieces) const {
  if (pieces != nullptr) pieces->clear();
  const auto start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t end = start + bytes;
  for (uintptr_t at = start; at < end;) {
    const Range* r = Holding(at);
    if (r == nullptr) return false;
    const uintptr_t stop = std::min<uintptr_t>(end, r->base + r->bytes);
    if (pieces != nullptr) pieces->push_back({at - start, stop - at});
    at = stop;
  }
  return true;
}

}  // namespace psclient::internal
