// CheckpointWriter (daemon/checkpoint_writer.h): requests that come while a snapshot is written are
// deferred and answered by one snapshot after it, not one each.
#include "daemon/checkpoint_writer.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

using psd::server::CheckpointWriter;
using psd::server::ShardSnapshot;

TEST_CASE("requests during a write are deferred into one snapshot after it", "[checkpoint]") {
  std::mutex m;
  std::condition_variable cv;
  bool release = false, started = false;
  std::atomic<int> writes{0}, again{0};
  CheckpointWriter writer(
      [&](const ShardSnapshot&) {
        std::unique_lock<std::mutex> lock(m);
        started = true;
        cv.notify_all();
        cv.wait(lock, [&] { return release; });
        ++writes;
      },
      [&] { ++again; });
  writer.Start();
  CHECK_FALSE(writer.Defer());  // idle: the caller snapshots now
  writer.Queue(ShardSnapshot{});
  {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return started; });
  }
  CHECK(writer.Busy());
  for (int i = 0; i < 100; ++i) CHECK(writer.Defer());  // a storm while it writes
  {
    std::lock_guard<std::mutex> lock(m);
    release = true;
  }
  cv.notify_all();
  for (int i = 0; i < 2000 && again.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  CHECK(writes.load() == 1);
  CHECK(again.load() == 1);  // one snapshot asked for all of them
  writer.Stop();
  CHECK(again.load() == 1);
}

TEST_CASE("a deferred request is answered by a snapshot queued after it, not by one queued before", "[checkpoint]") {
  for (bool queued_after : {false, true}) {
    INFO("queued after the request: " << queued_after);
    std::mutex m;
    std::condition_variable cv;
    bool release = false;
    int started = 0;
    std::atomic<int> writes{0}, again{0};
    CheckpointWriter writer(
        [&](const ShardSnapshot&) {
          std::unique_lock<std::mutex> lock(m);
          ++started;
          cv.notify_all();
          cv.wait(lock, [&] { return release; });
          ++writes;
        },
        [&] { ++again; });
    writer.Start();
    writer.Queue(ShardSnapshot{});  // A, being written
    {
      std::unique_lock<std::mutex> lock(m);
      cv.wait(lock, [&] { return started == 1; });
    }
    if (!queued_after) writer.Queue(ShardSnapshot{});  // B, older than the request
    CHECK(writer.Defer());
    if (queued_after) writer.Queue(ShardSnapshot{});  // B, taken after the request: it answers it
    {
      std::lock_guard<std::mutex> lock(m);
      release = true;
    }
    cv.notify_all();
    for (int i = 0; i < 2000 && writes.load() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (!queued_after) {
      for (int i = 0; i < 2000 && again.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    writer.Stop();
    CHECK(writes.load() == 2);
    CHECK(again.load() == (queued_after ? 0 : 1));
  }
}
