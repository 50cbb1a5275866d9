// Buffer's storage: big buffers' storage kept and given to the next buffer of the same size.
#include "core/buffer.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

using psd::server::Buffer;
using psd::server::kRecycledBufferBudget;
using psd::server::kRecycledBufferBytes;
using psd::server::RecycledBufferStats;
using psd::server::ReleaseRecycledBuffers;

namespace {

uint64_t Held() { return RecycledBufferStats().held_bytes; }

bool AllZero(const Buffer& b, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(b.data());
  for (size_t i = 0; i < bytes; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("a big buffer's storage goes to the next buffer of its size, zeroed or copied into as asked", "[buffer]") {
  ReleaseRecycledBuffers();
  const uint64_t reused = RecycledBufferStats().reused;
  const size_t bytes = kRecycledBufferBytes + 5;  // the padding word is set too
  const size_t padded = (bytes + 7) / 8 * 8;
  Buffer source(bytes);
  for (size_t i = 0; i < bytes; ++i) static_cast<unsigned char*>(source.data())[i] = static_cast<unsigned char>(i * 7);
  const void* storage = nullptr;
  {
    Buffer a(bytes, Buffer::Uninitialized{});
    std::memset(a.data(), 0xab, bytes);
    storage = a.data();
    CHECK(Held() == 0);
  }
  CHECK(Held() == padded);
  {
    Buffer zeroed(bytes);
    CHECK(zeroed.data() == storage);
    CHECK(Held() == 0);
    CHECK(RecycledBufferStats().reused == reused + 1);
    CHECK(AllZero(zeroed, padded));  // the bytes and the padding after them
    std::memset(zeroed.data(), 0xcd, bytes);
  }
  {
    Buffer other(bytes + 4096);  // another size does not take it
    CHECK(other.data() != storage);
    CHECK(Held() == padded);
  }
  CHECK(Held() == padded + (bytes + 4096 + 7) / 8 * 8);
  {
    Buffer copy(source);  // a copy of its size does, and holds the copied bytes (the padding zero)
    CHECK(copy.data() == storage);
    CHECK(RecycledBufferStats().reused == reused + 2);
    CHECK(std::memcmp(copy.data(), source.data(), padded) == 0);
  }
  ReleaseRecycledBuffers();
  CHECK(Held() == 0);
}

TEST_CASE("buffers under the recycled size are freed, not kept", "[buffer]") {
  ReleaseRecycledBuffers();
  { Buffer small(kRecycledBufferBytes - 8); }
  CHECK(Held() == 0);
  { Buffer big(kRecycledBufferBytes); }
  CHECK(Held() == kRecycledBufferBytes);
  ReleaseRecycledBuffers();
}

TEST_CASE("kept storage stays within its budget, the oldest let go first, the newest kept even alone over it",
          "[buffer]") {
  ReleaseRecycledBuffers();
  const size_t block = kRecycledBufferBudget * 2 / 5 / 8 * 8;  // two fit the budget, three do not
  const void* first = nullptr;
  {
    Buffer a(block, Buffer::Uninitialized{});
    Buffer b(block + 8, Buffer::Uninitialized{});
    Buffer c(block + 16, Buffer::Uninitialized{});
    first = a.data();
  }  // c, b, then a go: a (let go last) and b are kept, c is freed
  CHECK(Held() == 2 * block + 8);
  {
    Buffer again(block, Buffer::Uninitialized{});
    CHECK(again.data() == first);
    Buffer gone(block + 16, Buffer::Uninitialized{});
    CHECK(Held() == block + 8);
  }
  // gone, then again were let go: with b over the budget, so b (the oldest) was freed.
  CHECK(Held() == 2 * block + 16);
  { Buffer huge(kRecycledBufferBudget + 8, Buffer::Uninitialized{}); }
  CHECK(Held() == kRecycledBufferBudget + 8);  // alone over the budget, still kept; the rest freed
  ReleaseRecycledBuffers();
  CHECK(Held() == 0);
}

TEST_CASE("a buffer lists the changes said since it was copied, until a write that says nothing", "[buffer]") {
  Buffer from(4096);
  Buffer copy(from);
  CHECK(copy.id() != from.id());
  CHECK(copy.copied_from() == 0);  // a copy alone lists nothing: who writes it is not known
  copy.MarkCopiedFrom(from);
  CHECK(copy.copied_from() == from.id());
  copy.MarkChanged(512, 16);
  copy.MarkChanged(528, 16);  // runs on from the one before: one run
  copy.MarkChanged(0, 8);
  static_cast<char*>(copy.listed_data())[0] = 1;
  CHECK(copy.changes() == std::vector<std::pair<uint64_t, uint64_t>>{{512, 32}, {0, 8}});
  CHECK(copy.copied_from() == from.id());
  Buffer moved(std::move(copy));
  CHECK(moved.copied_from() == from.id());  // a move keeps the list (and the id)
  CHECK(moved.changes().size() == 2);
  const Buffer& reader = moved;
  CHECK(reader.data() != nullptr);  // reading ends nothing
  CHECK(moved.copied_from() == from.id());
  static_cast<char*>(moved.data())[1] = 1;  // a write that says nothing ends the list
  CHECK(moved.copied_from() == 0);
  moved.MarkChanged(8, 8);
  CHECK(moved.copied_from() == 0);  // until it is copied again

  // Past half the bytes, or one run per 2 KiB (64 at least), the list ends: a whole comparison pays.
  Buffer half(4096);
  half.MarkCopiedFrom(from);
  half.MarkChanged(0, 2048);
  CHECK(half.copied_from() == from.id());
  half.MarkChanged(3000, 8);
  CHECK(half.copied_from() == 0);
  Buffer runs(4096);
  runs.MarkCopiedFrom(from);
  for (uint64_t i = 0; i < 64; ++i) runs.MarkChanged(i * 32, 8);
  CHECK(runs.copied_from() == from.id());
  runs.MarkChanged(4000, 8);
  CHECK(runs.copied_from() == 0);
}

TEST_CASE("a retired buffer is brought up to date by copying only what the copies since listed", "[buffer]") {
  // Z, then X copied from Z and Y from X, each writing and listing a few bytes (the engine's
  // values of three steps). Z's storage becomes Y's value again.
  Buffer z(4096);
  for (int i = 0; i < 4096; ++i) static_cast<uint8_t*>(z.data())[i] = static_cast<uint8_t>(i * 7);
  Buffer x(z);
  x.MarkCopiedFrom(z);
  x.MarkChanged(100, 50);
  std::memset(static_cast<char*>(x.listed_data()) + 100, 1, 50);
  Buffer y(x);
  y.MarkCopiedFrom(x);
  y.MarkChanged(4000, 96);
  std::memset(static_cast<char*>(y.listed_data()) + 4000, 2, 96);
  y.MarkChanged(120, 4);
  std::memset(static_cast<char*>(y.listed_data()) + 120, 3, 4);

  Buffer into(z);  // Z's bytes, with a byte no list names changed: left alone when only lists are copied
  into.MarkCopiedFrom(z);
  const uint64_t z_id = into.id();
  x.MarkCopiedFrom(into);  // (as if X had been copied from this one: the same bytes)
  x.MarkChanged(100, 50);
  static_cast<uint8_t*>(into.listed_data())[2000] = 0xEE;
  REQUIRE(into.CatchUp(y, {&x}));
  const auto* got = static_cast<const uint8_t*>(static_cast<const Buffer&>(into).data());
  const auto* want = static_cast<const uint8_t*>(static_cast<const Buffer&>(y).data());
  CHECK(std::memcmp(got, want, 2000) == 0);
  CHECK(got[2000] == 0xEE);
  CHECK(std::memcmp(got + 2001, want + 2001, 4096 - 2001) == 0);
  CHECK(into.id() != z_id);  // another value now
  CHECK(into.copied_from() == y.id());
  CHECK(into.changes().empty());

  // A chain that does not lead from this buffer, or a copy whose list ended: copied whole.
  Buffer stranger(z);
  static_cast<uint8_t*>(stranger.data())[2000] = 0xEE;
  CHECK_FALSE(stranger.CatchUp(y, {}));  // Y was not copied from it
  CHECK(std::memcmp(static_cast<const Buffer&>(stranger).data(), static_cast<const Buffer&>(y).data(), 4096) == 0);
  Buffer again(z);
  x.MarkCopiedFrom(again);
  x.MarkChanged(100, 50);
  static_cast<char*>(y.data())[0] = 9;  // a write that says nothing: Y's list ends
  CHECK_FALSE(again.CatchUp(y, {&x}));
  CHECK(std::memcmp(static_cast<const Buffer&>(again).data(), static_cast<const Buffer&>(y).data(), 4096) == 0);
}
