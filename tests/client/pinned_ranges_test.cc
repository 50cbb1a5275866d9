// The client's pinned host ranges (client/src/pinned_ranges.h): which pages a host twin still
// needs pinned, and how a copy in pinned memory splits at the registrations it spans (CUDA
// refuses one cudaMemcpyAsync across two: cudaErrorInvalidValue, seen on an H200 with twins that
// share a page). Addresses only: no memory is touched.
#include "../client/src/pinned_ranges.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <vector>

using psclient::internal::PinnedRanges;

namespace {

constexpr size_t kPage = 4096;
const void* At(uintptr_t a) { return reinterpret_cast<const void*>(a); }

bool Same(const std::vector<PinnedRanges::Range>& got, const std::vector<PinnedRanges::Range>& want) {
  if (got.size() != want.size()) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i].base != want[i].base || got[i].bytes != want[i].bytes) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("a block is pinned as whole pages, and pages pinned before are not pinned again", "[client][pinned]") {
  PinnedRanges pinned;
  constexpr uintptr_t base = 0x100000;
  // A 64-byte-aligned block of 3 pages and a bit, starting in a page: rounded out to 4 pages.
  auto first = pinned.Missing(At(base + 64), 3 * kPage + 100, kPage);
  CHECK(Same(first, {{base, 4 * kPage}}));
  for (auto r : first) pinned.Add(r);
  CHECK(pinned.Missing(At(base + 64), 3 * kPage + 100, kPage).empty());
  CHECK(pinned.Covers(At(base + 64), 3 * kPage + 100));

  // The next block starts in the first one's last page: only the pages after it are missing.
  const uintptr_t second = base + 3 * kPage + 164;
  auto rest = pinned.Missing(At(second), 2 * kPage, kPage);
  CHECK(Same(rest, {{base + 4 * kPage, 2 * kPage}}));
  CHECK_FALSE(pinned.Covers(At(second), 2 * kPage));
  for (auto r : rest) pinned.Add(r);
  CHECK(pinned.Covers(At(second), 2 * kPage));

  // A block over a gap between two registrations gets the gap alone.
  pinned.Add({base + 8 * kPage, kPage});
  auto gap = pinned.Missing(At(base + 5 * kPage), 4 * kPage, kPage);
  CHECK(Same(gap, {{base + 6 * kPage, 2 * kPage}}));
  CHECK(pinned.Missing(At(base), 0, kPage).empty());
}

TEST_CASE("a copy in pinned memory is split where one registration ends and the next begins", "[client][pinned]") {
  PinnedRanges pinned;
  constexpr uintptr_t base = 0x200000;
  pinned.Add({base, 2 * kPage});
  pinned.Add({base + 2 * kPage, 3 * kPage});  // adjacent: a block that shared base's last page

  std::vector<PinnedRanges::Range> pieces;
  // Inside one registration: one piece, the whole copy.
  REQUIRE(pinned.Pieces(At(base + 128), kPage, &pieces));
  CHECK(Same(pieces, {{0, kPage}}));
  // Across the boundary: two pieces, offsets from the copy's start, lengths summing to it.
  const uintptr_t start = base + 2 * kPage - 1000;
  REQUIRE(pinned.Pieces(At(start), 5000, &pieces));
  CHECK(Same(pieces, {{0, 1000}, {1000, 4000}}));
  // Up to the last byte pinned: covered; one byte further: not, and nothing is copied direct.
  CHECK(pinned.Covers(At(base), 5 * kPage));
  CHECK_FALSE(pinned.Covers(At(base), 5 * kPage + 1));
  CHECK_FALSE(pinned.Pieces(At(base - 1), 10, &pieces));
  // Nothing to copy: covered, no pieces.
  REQUIRE(pinned.Pieces(At(base), 0, &pieces));
  CHECK(pieces.empty());
}
