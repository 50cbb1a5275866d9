// PrefetchRow: asks the CPU to fetch the first bytes of a row that will be read (or written) soon.
// For passes over rows far apart in memory (a big table's sparse rows, the rows of a gradient a
// stripe takes): each row would otherwise wait for memory in turn.
#ifndef PSD_COMMON_BASE_PREFETCH_H_
#define PSD_COMMON_BASE_PREFETCH_H_

#include <algorithm>
#include <cstdint>

namespace psd {

// The first min(row_bytes, 256) bytes of `row`, a cache line at a time. `for_write`: the row will
// be written (fetched for ownership).
inline void PrefetchRow(const void* row, uint64_t row_bytes, bool for_write) {
  const auto* p = static_cast<const char*>(row);
  const uint64_t bytes = std::min<uint64_t>(row_bytes, 256);
  for (uint64_t b = 0; b < bytes; b += 64) {
    if (for_write) {
      __builtin_prefetch(p + b, 1);
    } else {
      __builtin_prefetch(p + b, 0);
    }
  }
}

}  // namespace psd

#endif  // PSD_COMMON_BASE_PREFETCH_H_
