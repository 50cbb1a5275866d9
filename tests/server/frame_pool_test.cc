// FramePool: big frames' body buffers, reused, and never more of them kept than the budget's limit.
#include "net/frame_pool.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

using psd::server::FramePool;

namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kWord = sizeof(capnp::word);

uint64_t Bytes(const kj::Array<capnp::word>& a) { return a.size() * kWord; }

}  // namespace

TEST_CASE("small frames' buffers come from the heap, big ones are mapped in granules", "[frame_pool]") {
  FramePool pool(1 << 20);
  auto small = pool.Take(FramePool::kMinBytes / kWord - 1);
  CHECK(Bytes(small) == FramePool::kMinBytes - kWord);
  CHECK(pool.maps() == 0);
  CHECK(pool.handed_out_bytes() == 0);
  auto big = pool.Take(100 * kKiB / kWord);  // rounded up to two granules
  CHECK(Bytes(big) == 2 * FramePool::kGranule);
  CHECK(pool.maps() == 1);
  CHECK(pool.handed_out_bytes() == 2 * FramePool::kGranule);
  std::memset(static_cast<void*>(big.begin()), 0xab, Bytes(big));  // the whole buffer is the caller's
  big = nullptr;
  CHECK(pool.handed_out_bytes() == 0);
  CHECK(pool.kept_bytes() == 2 * FramePool::kGranule);
}

TEST_CASE("a buffer given back is handed out again, not mapped anew", "[frame_pool]") {
  FramePool pool(4 << 20);
  auto a = pool.Take((1 << 20) / kWord);
  const capnp::word* first = a.begin();
  a = nullptr;
  auto b = pool.Take((1 << 20) / kWord - 5);  // a slightly smaller frame fits the same buffer
  CHECK(b.begin() == first);
  CHECK(pool.maps() == 1);
  CHECK(pool.reuses() == 1);
  // One more than a quarter bigger than the frame is not used for it (the budget charges the
  // frame's bytes): a new one is mapped.
  b = nullptr;
  auto c = pool.Take(200 * kKiB / kWord);
  CHECK(c.begin() != first);
  auto d = pool.Take(640 * kKiB / kWord);
  CHECK(d.begin() != first);
  CHECK(pool.maps() == 3);
  CHECK(pool.kept_bytes() == (1 << 20));
  d = nullptr;
  auto e = pool.Take(820 * kKiB / kWord);  // 832 KiB in granules: 1 MiB is within a quarter of it
  CHECK(e.begin() == first);
}

TEST_CASE("the pool keeps at most its limit, counting what is handed out", "[frame_pool]") {
  const uint64_t half = 512 * kKiB;
  FramePool pool(1 << 20);
  std::vector<kj::Array<capnp::word>> out;
  for (int i = 0; i < 3; ++i) out.push_back(pool.Take(half / kWord));
  CHECK(pool.handed_out_bytes() == 3 * half);  // the budget bounds what is handed out, not the pool
  out[0] = nullptr;                            // 1 MiB still out: nothing more may be kept
  CHECK(pool.kept_bytes() == 0);
  out[1] = nullptr;
  out[2] = nullptr;
  CHECK(pool.handed_out_bytes() == 0);
  CHECK(pool.kept_bytes() == 2 * half);
  // A frame that no kept buffer holds is mapped, and kept ones are unmapped to make room.
  auto big = pool.Take((768 * kKiB) / kWord);
  CHECK(pool.handed_out_bytes() == 768 * kKiB);
  CHECK(pool.kept_bytes() == 0);
  big = nullptr;
  CHECK(pool.kept_bytes() == 768 * kKiB);
  // A frame bigger than the limit is served, and unmapped when given back.
  auto huge = pool.Take((2 << 20) / kWord);
  CHECK(pool.kept_bytes() == 0);
  huge = nullptr;
  CHECK(pool.kept_bytes() == 0);
  CHECK(pool.handed_out_bytes() == 0);
}

TEST_CASE("an InFrame gives its buffer back before it takes a bigger one", "[frame_pool]") {
  FramePool pool(1 << 20);
  psd::wire::InFrame in(&pool);
  std::vector<uint32_t> sizes{static_cast<uint32_t>(300 * kKiB / kWord)};
  capnp::word* first = in.Prepare(sizes, sizes[0]);
  CHECK(in.capacity_bytes() == 320 * kKiB);
  sizes[0] = static_cast<uint32_t>(600 * kKiB / kWord);
  in.Prepare(sizes, sizes[0]);
  // 320 KiB kept + 640 KiB out fits the limit: the first buffer waits in the pool for the next frame.
  CHECK(pool.handed_out_bytes() == 640 * kKiB);
  CHECK(pool.kept_bytes() == 320 * kKiB);
  in.Release();
  psd::wire::InFrame other(&pool);
  sizes[0] = static_cast<uint32_t>(300 * kKiB / kWord);
  CHECK(other.Prepare(sizes, sizes[0]) == first);
}

TEST_CASE("threads taking and giving back buffers keep the pool's books", "[frame_pool]") {
  const uint64_t limit = 4 << 20;
  FramePool pool(limit);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, t] {
      std::mt19937 rng(static_cast<uint32_t>(t));
      std::uniform_int_distribution<uint64_t> words(1, (2 << 20) / kWord);
      std::vector<kj::Array<capnp::word>> held;
      for (int i = 0; i < 500; ++i) {
        auto a = pool.Take(words(rng));
        // Touched at both ends: a buffer unmapped while handed out would fault here.
        std::memset(static_cast<void*>(a.begin()), t, kWord);
        std::memset(static_cast<void*>(a.end() - 1), t, kWord);
        held.push_back(std::move(a));
        if (held.size() > 2) held.erase(held.begin());
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(pool.handed_out_bytes() == 0);
  CHECK(pool.kept_bytes() <= limit);
  CHECK(pool.maps() + pool.reuses() <= 4 * 500);
  CHECK(pool.reuses() > 0);
}
