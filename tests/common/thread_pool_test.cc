// ThreadPool (common/base): ParallelFor covers its range once, from several callers at a time, and
// ParallelCopy copies every byte whatever the size and alignment.
#include "base/thread_pool.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <thread>
#include <vector>

using psd::ThreadPool;

TEST_CASE("ParallelFor runs every index once, the caller included, from concurrent callers", "[pool]") {
  ThreadPool pool(3);
  constexpr int64_t kN = 100'000;
  std::vector<std::atomic<int>> seen(kN);
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      pool.ParallelFor(kN, 1000, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) seen[static_cast<size_t>(i)].fetch_add(1);
      });
    });
  }
  for (auto& t : callers) t.join();
  for (int64_t i = 0; i < kN; ++i) REQUIRE(seen[static_cast<size_t>(i)].load() == 4);
}

TEST_CASE("ParallelCopy copies every byte: small, odd-sized, misaligned and split over the pool", "[pool]") {
  ThreadPool pool(3), none(0);
  std::vector<uint8_t> src((8 << 20) + 123);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
  for (ThreadPool* p : {&pool, &none}) {
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{4095}, size_t{1} << 20, (size_t{5} << 20) + 7, src.size() - 3}) {
      std::vector<uint8_t> dst(bytes + 2, 0xEE);
      p->ParallelCopy(dst.data() + 1, src.data() + 3, bytes);  // both off their alignment
      REQUIRE(dst[0] == 0xEE);
      REQUIRE(dst[bytes + 1] == 0xEE);  // nothing past the end
      REQUIRE(std::equal(dst.begin() + 1, dst.begin() + 1 + static_cast<std::ptrdiff_t>(bytes), src.begin() + 3));
    }
  }
}

TEST_CASE("in a process forked after the pool started, ParallelFor and ParallelCopy run on the caller", "[pool]") {
  ThreadPool pool(3);
  std::vector<uint8_t> src(4 << 20, 7), dst(4 << 20, 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // No helper threads here: the work must not wait for them.
    std::atomic<int64_t> sum{0};
    pool.ParallelFor(1000, 10, [&](int64_t b, int64_t e) { sum += e - b; });
    pool.ParallelCopy(dst.data(), src.data(), src.size());
    _exit(sum == 1000 && dst == src ? 0 : 1);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}
