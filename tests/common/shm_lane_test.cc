// ShmLane (common/wire/shm_lane.h): the rings carry every byte in order across wrap-arounds, a
// side that sleeps is woken by the other's write or read, and an index a peer could never have
// left breaks the lane instead of letting the reader run outside its ring.
#include "wire/shm_lane.h"

#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

using psd::wire::ShmLane;

namespace {

// The worker's side of `daemon`'s lane, as a worker adopts it (from duplicates of its descriptors).
std::shared_ptr<ShmLane> WorkerSide(const ShmLane& daemon) {
  std::vector<int> fds;
  for (int fd : daemon.Fds()) fds.push_back(::dup(fd));
  auto lane = ShmLane::Adopt(fds);
  REQUIRE(lane.ok());
  return *lane;
}

bool Readable(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, ms) == 1;
}

// The lane's segment's first page (its rings' indices) mapped again, as a scribbling worker has it.
struct IndexPage {
  explicit IndexPage(const ShmLane& lane) {
    void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, lane.Fds()[0], 0);
    REQUIRE(p != MAP_FAILED);
    page = static_cast<uint8_t*>(p);
  }
  ~IndexPage() { ::munmap(page, 4096); }
  uint64_t& at(size_t byte_offset) { return *reinterpret_cast<uint64_t*>(page + byte_offset); }
  uint8_t* page;
};

}  // namespace

TEST_CASE("a lane carries bytes both ways in order, across its rings' wrap-arounds", "[shm_lane]") {
  auto daemon = ShmLane::Create(4096);
  REQUIRE(daemon.ok());
  auto worker = WorkerSide(**daemon);
  CHECK(worker->ring_bytes() == 4096);
  // Messages of sizes that do not divide the ring, several per fill, so the copies wrap.
  std::vector<uint8_t> sent, got;
  uint32_t seed = 7;
  for (int round = 0; round < 200; ++round) {
    const size_t n = 1 + (seed = seed * 1103515245u + 12345u) % 3000;
    std::vector<uint8_t> msg(n);
    for (auto& b : msg) b = static_cast<uint8_t>(seed = seed * 1103515245u + 12345u);
    size_t off = 0;
    while (off < n) {
      off += worker->Write(msg.data() + off, n - off);
      // What the daemon takes, in two reads of different sizes (a header, then the rest).
      uint8_t buf[5000];
      size_t k = (*daemon)->Read(buf, 8);
      k += (*daemon)->Read(buf + k, sizeof(buf) - k);
      got.insert(got.end(), buf, buf + k);
    }
    sent.insert(sent.end(), msg.begin(), msg.end());
    // And back, gathered from two buffers into one publish.
    psd::asio::const_buffer parts[2] = {psd::asio::buffer(msg.data(), n / 2),
                                        psd::asio::buffer(msg.data() + n / 2, n - n / 2)};
    size_t back = 0;
    std::vector<uint8_t> echoed;
    while (back < n) {
      back += (*daemon)->Write(parts, parts + 2, back);
      uint8_t buf[5000];
      size_t k = worker->Read(buf, sizeof(buf));
      echoed.insert(echoed.end(), buf, buf + k);
    }
    uint8_t buf[5000];
    size_t k;
    while ((k = worker->Read(buf, sizeof(buf))) > 0) echoed.insert(echoed.end(), buf, buf + k);
    REQUIRE(echoed == msg);
  }
  CHECK(got == sent);
  CHECK(!(*daemon)->broken());
  CHECK(!worker->broken());
}

TEST_CASE("a side that sleeps on its lane is woken by the other side's write or read", "[shm_lane]") {
  auto daemon = ShmLane::Create(4096);
  REQUIRE(daemon.ok());
  auto worker = WorkerSide(**daemon);
  using Wait = ShmLane::Wait;

  // Nothing to read: the daemon may sleep; nothing rings until the worker writes.
  REQUIRE((*daemon)->PrepareWait(Wait::kData));
  CHECK(!Readable((*daemon)->WaitFd(Wait::kData), 0));
  std::thread writer([&] { CHECK(worker->Write("hello", 5) == 5); });
  CHECK(Readable((*daemon)->WaitFd(Wait::kData), 10000));
  writer.join();
  (*daemon)->FinishWait(Wait::kData);
  CHECK(!Readable((*daemon)->WaitFd(Wait::kData), 0));  // drained
  // Bytes there already: no sleep.
  CHECK(!(*daemon)->PrepareWait(Wait::kData));
  char buf[8];
  CHECK((*daemon)->Read(buf, sizeof(buf)) == 5);

  // A full reply ring: the daemon sleeps for room, the worker's read rings it.
  std::vector<uint8_t> fill(4096, 1);
  CHECK((*daemon)->Write(fill.data(), fill.size()) == 4096);
  CHECK((*daemon)->Write(fill.data(), 1) == 0);
  REQUIRE((*daemon)->PrepareWait(Wait::kRoom));
  std::thread reader([&] { CHECK(worker->Read(fill.data(), 100) == 100); });
  CHECK(Readable((*daemon)->WaitFd(Wait::kRoom), 10000));
  reader.join();
  (*daemon)->FinishWait(Wait::kRoom);
  CHECK((*daemon)->Write(fill.data(), 200) == 100);

  // The worker sleeps for a reply on its one doorbell; the daemon's write rings it.
  uint8_t drain[4096];
  while (worker->Read(drain, sizeof(drain)) > 0) {
  }
  REQUIRE(worker->PrepareWait(Wait::kData));
  CHECK((*daemon)->Write("x", 1) == 1);
  CHECK(Readable(worker->WaitFd(Wait::kData), 10000));
  worker->FinishWait(Wait::kData);
  // Nobody sleeps: no doorbell rings (a write costs no system call).
  CHECK((*daemon)->Write("y", 1) == 1);
  CHECK(!Readable(worker->WaitFd(Wait::kData), 0));
}

TEST_CASE("an index a worker could never have left breaks the daemon's side of the lane", "[shm_lane]") {
  auto daemon = ShmLane::Create(4096);
  REQUIRE(daemon.ok());
  auto worker = WorkerSide(**daemon);
  IndexPage indices(**daemon);
  // The request ring's indices are at 0 (head, the daemon's) and 64 (tail, the worker's); the
  // reply ring's at 512 and 576.
  SECTION("a request tail beyond what the ring holds") {
    indices.at(64) = 4097;
    char buf[16];
    CHECK((*daemon)->Read(buf, sizeof(buf)) == 0);
    CHECK((*daemon)->broken());
    CHECK(!(*daemon)->PrepareWait(ShmLane::Wait::kData));  // nothing to sleep for
  }
  SECTION("a request tail behind what the daemon read") {
    CHECK(worker->Write("abcdef", 6) == 6);
    char buf[16];
    CHECK((*daemon)->Read(buf, sizeof(buf)) == 6);
    indices.at(64) = 3;
    CHECK((*daemon)->Read(buf, sizeof(buf)) == 0);
    CHECK((*daemon)->broken());
  }
  SECTION("a reply head past what the daemon wrote") {
    indices.at(512) = 10;
    CHECK((*daemon)->Write("abc", 3) == 0);
    CHECK((*daemon)->broken());
  }
  SECTION("the daemon's own index scribbled over is never read back") {
    CHECK(worker->Write("abcdef", 6) == 6);
    indices.at(0) = 1000;  // the request head, the daemon's: it keeps its own copy
    char buf[16];
    CHECK((*daemon)->Read(buf, sizeof(buf)) == 6);
    CHECK(std::memcmp(buf, "abcdef", 6) == 0);
    CHECK(!(*daemon)->broken());
  }
}

TEST_CASE("a lane is adopted only from a segment of its own shape with its doorbells", "[shm_lane]") {
  CHECK(!ShmLane::Create(3000).ok());  // not a power of two
  CHECK(!ShmLane::Create(1024).ok());  // too small
  auto daemon = ShmLane::Create(8192);
  REQUIRE(daemon.ok());
  std::vector<int> three;
  for (int i = 0; i < 3; ++i) three.push_back(::dup((*daemon)->Fds()[static_cast<size_t>(i)]));
  auto short_of_one = ShmLane::Adopt(three);
  REQUIRE(!short_of_one.ok());
  CHECK_THAT(short_of_one.status().message(), Catch::Contains("4 descriptors"));
  // A segment of another shape (a plain 64 KiB one: not 4 KiB and two rings of a power of two).
  auto other = psd::wire::SharedSegment::Create(4096 + 3 * 4096, "odd");
  REQUIRE(other.ok());
  std::vector<int> fds{::dup((*other)->fd())};
  for (int i = 1; i < 4; ++i) fds.push_back(::dup((*daemon)->Fds()[static_cast<size_t>(i)]));
  auto odd = ShmLane::Adopt(fds);
  REQUIRE(!odd.ok());
  CHECK_THAT(odd.status().message(), Catch::Contains("is not 4 KiB and two rings"));
}
