// The host memory a DeviceStaging has pinned for DMA (cudaHostRegister), as whole-page ranges,
// and the range arithmetic on them — kept apart from CUDA so that it is tested in CPU builds.
//
// CUDA pins whole pages and refuses a page pinned already, so a block that shares a page with one
// pinned before is pinned in pieces (Missing). Each piece is its own registration, and a
// cudaMemcpyAsync whose host side spans two registrations fails (cudaErrorInvalidValue): a copy
// in pinned memory goes in one cudaMemcpyAsync per registration it touches (Pieces).
//
// Thread-safety: none (a DeviceStaging's, whose Client serializes its calls).
#ifndef PSCLIENT_SRC_PINNED_RANGES_H_
#define PSCLIENT_SRC_PINNED_RANGES_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace psclient::internal {

class PinnedRanges {
 public:
  struct Range {
    uintptr_t base;
    size_t bytes;
  };
  // The ranges to pin so that [p, p + bytes) is covered: that range rounded out to whole pages of
  // `page` bytes, less what is pinned already, in address order. Empty when it is covered.
  std::vector<Range> Missing(const void* p, size_t bytes, size_t page) const;
  // Records a range pinned (one registration).
  void Add(Range r) { ranges_.push_back(r); }
  // Whether [p, p + bytes) is covered by pinned ranges, together.
  bool Covers(const void* p, size_t bytes) const { return Pieces(p, bytes, nullptr); }
  // Splits [p, p + bytes) at the boundaries of the registrations it lies in: each piece, as
  // {offset from p, length}, lies in one. False (and `pieces` unspecified) when not covered.
  bool Pieces(const void* p, size_t bytes, std::vector<Range>* pieces) const;
  const std::vector<Range>& ranges() const { return ranges_; }

 private:
  // The range holding address `at`, or null.
  const Range* Holding(uintptr_t at) const;
  std::vector<Range> ranges_;
};

}  // namespace psclient::internal

#endif  // PSCLIENT_SRC_PINNED_RANGES_H_
