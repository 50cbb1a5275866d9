#include "wire/shm_lane.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <string>

namespace psd::wire {

// One ring's indices and flags, each on its own cache line: the consumer's head (bytes read), the
// producer's tail (bytes written), and whether either sleeps on its doorbell.
struct ShmLane::Ring {
  alignas(64) std::atomic<uint64_t> head{0};
  alignas(64) std::atomic<uint64_t> tail{0};
  alignas(64) std::atomic<uint32_t> consumer_waits{0};
  alignas(64) std::atomic<uint32_t> producer_waits{0};
};

namespace {

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "the rings' indices are shared between processes: their atomics must be lock-free");
constexpr uint64_t kRingHeaderBytes = 512;  // the requests' ring at 0, the replies' at 512

int NewDoorbell() { return ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC); }

bool PowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

}  // namespace

ShmLane::ShmLane(Side side, std::shared_ptr<SharedSegment> segment, uint64_t cap, int data_fd, int room_fd,
                 int worker_fd)
    : side_(side),
      segment_(std::move(segment)),
      cap_(cap),
      data_fd_(data_fd),
      room_fd_(room_fd),
      worker_fd_(worker_fd) {}

ShmLane::~ShmLane() {
  ::close(data_fd_);
  ::close(room_fd_);
  ::close(worker_fd_);
}

Result<std::shared_ptr<ShmLane>> ShmLane::Create(uint64_t ring_bytes) {
  static_assert(sizeof(Ring) <= kRingHeaderBytes && 2 * kRingHeaderBytes <= kHeaderBytes);
  if (!PowerOfTwo(ring_bytes) || ring_bytes < kMinRingBytes || ring_bytes > kMaxRingBytes) {
    return InvalidArgument("a lane's rings take a power of two of bytes in [" + std::to_string(kMinRingBytes) + ", " +
                           std::to_string(kMaxRingBytes) + "], not " + std::to_string(ring_bytes));
  }
  auto segment = SharedSegment::Create(kHeaderBytes + 2 * ring_bytes, "psd-lane");
  if (!segment.ok()) return segment.status();
  int fds[3] = {NewDoorbell(), NewDoorbell(), NewDoorbell()};
  if (fds[0] < 0 || fds[1] < 0 || fds[2] < 0) {
    const std::string why = std::string("eventfd: ") + std::strerror(errno);
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
    return Unavailable(why);
  }
  uint8_t* base = (*segment)->data();
  new (base) Ring();
  new (base + kRingHeaderBytes) Ring();
  return std::shared_ptr<ShmLane>(new ShmLane(Side::kDaemon, std::move(*segment), ring_bytes, fds[0], fds[1], fds[2]));
}

Result<std::shared_ptr<ShmLane>> ShmLane::Adopt(const std::vector<int>& fds) {
  auto close_doorbells = [&] {
    for (size_t i = 1; i < fds.size(); ++i) ::close(fds[i]);
  };
  if (fds.size() != kFds) {
    for (int fd : fds) ::close(fd);
    return InvalidArgument("a lane comes with " + std::to_string(kFds) + " descriptors, not " +
                           std::to_string(fds.size()));
  }
  auto segment = SharedSegment::Adopt(fds[0], kHeaderBytes + 2 * kMaxRingBytes);
  if (!segment.ok()) {
    close_doorbells();
    return segment.status();
  }
  const uint64_t size = (*segment)->size();
  const uint64_t cap = size > kHeaderBytes ? (size - kHeaderBytes) / 2 : 0;
  if (!PowerOfTwo(cap) || cap < kMinRingBytes || kHeaderBytes + 2 * cap != size) {
    close_doorbells();
    return InvalidArgument("a lane segment of " + std::to_string(size) + " bytes is not 4 KiB and two rings");
  }
  return std::shared_ptr<ShmLane>(new ShmLane(Side::kWorker, std::move(*segment), cap, fds[1], fds[2], fds[3]));
}

std::vector<int> ShmLane::Fds() const { return {segment_->fd(), data_fd_, room_fd_, worker_fd_}; }

ShmLane::Ring* ShmLane::incoming() const {
  return reinterpret_cast<Ring*>(segment_->data() + (side_ == Side::kDaemon ? 0 : kRingHeaderBytes));
}
ShmLane::Ring* ShmLane::outgoing() const {
  return reinterpret_cast<Ring*>(segment_->data() + (side_ == Side::kDaemon ? kRingHeaderBytes : 0));
}
uint8_t* ShmLane::incoming_bytes() const {
  return segment_->data() + kHeaderBytes + (side_ == Side::kDaemon ? 0 : cap_);
}
uint8_t* ShmLane::outgoing_bytes() const {
  return segment_->data() + kHeaderBytes + (side_ == Side::kDaemon ? cap_ : 0);
}

void ShmLane::Knock(int fd) {
  const uint64_t one = 1;
  ssize_t r;
  do {
    r = ::write(fd, &one, sizeof(one));
  } while (r < 0 && errno == EINTR);
  // EAGAIN: the counter is full, so the sleeper wakes anyway.
}

void ShmLane::Drain(int fd) {
  uint64_t count;
  ssize_t r;
  do {
    r = ::read(fd, &count, sizeof(count));
  } while (r < 0 && errno == EINTR);
}

size_t ShmLane::Readable() {
  if (broken()) return 0;
  const uint64_t held = incoming()->tail.load(std::memory_order_acquire) - read_at_;
  if (held > cap_) {  // the peer claims more than the ring holds (or a tail behind what was read)
    Break();
    return 0;
  }
  return static_cast<size_t>(held);
}

size_t ShmLane::Read(void* dst, size_t n) {
  const size_t take = std::min(n, Readable());
  if (take == 0) return 0;
  const uint64_t at = read_at_ & (cap_ - 1);
  const size_t first = static_cast<size_t>(std::min<uint64_t>(take, cap_ - at));
  std::memcpy(dst, incoming_bytes() + at, first);
  if (first < take) std::memcpy(static_cast<uint8_t*>(dst) + first, incoming_bytes(), take - first);
  read_at_ += take;
  Ring* r = incoming();
  r->head.store(read_at_, std::memory_order_seq_cst);
  if (r->producer_waits.load(std::memory_order_seq_cst) != 0) Knock(peer_room_fd());
  return take;
}

size_t ShmLane::Write(const asio::const_buffer* first, const asio::const_buffer* last, size_t skip) {
  if (broken()) return 0;
  Ring* r = outgoing();
  const uint64_t used = write_at_ - r->head.load(std::memory_order_acquire);
  if (used > cap_) {  // a head past what was written
    Break();
    return 0;
  }
  uint64_t room = cap_ - used;
  uint8_t* bytes = outgoing_bytes();
  size_t wrote = 0;
  for (const asio::const_buffer* b = first; b != last && room > 0; ++b) {
    size_t size = b->size();
    const auto* src = static_cast<const uint8_t*>(b->data());
    if (skip >= size) {
      skip -= size;
      continue;
    }
    src += skip;
    size -= skip;
    skip = 0;
    size_t take = static_cast<size_t>(std::min<uint64_t>(size, room));
    while (take > 0) {
      const uint64_t at = (write_at_ + wrote) & (cap_ - 1);
      const size_t part = static_cast<size_t>(std::min<uint64_t>(take, cap_ - at));
      std::memcpy(bytes + at, src, part);
      src += part;
      wrote += part;
      take -= part;
      room -= part;
    }
  }
  if (wrote == 0) return 0;
  write_at_ += wrote;
  r->tail.store(write_at_, std::memory_order_seq_cst);
  if (r->consumer_waits.load(std::memory_order_seq_cst) != 0) Knock(peer_data_fd());
  return wrote;
}

bool ShmLane::PrepareWait(Wait what) {
  std::atomic<uint32_t>& flag = what == Wait::kData ? incoming()->consumer_waits : outgoing()->producer_waits;
  flag.store(1, std::memory_order_seq_cst);
  bool ready;
  if (what == Wait::kData) {
    ready = Readable() > 0;
  } else {
    const uint64_t used = write_at_ - outgoing()->head.load(std::memory_order_seq_cst);
    if (used > cap_) Break();
    ready = used < cap_;
  }
  if (ready || broken()) {
    flag.store(0, std::memory_order_relaxed);
    return false;
  }
  return true;
}

void ShmLane::FinishWait(Wait what) {
  std::atomic<uint32_t>& flag = what == Wait::kData ? incoming()->consumer_waits : outgoing()->producer_waits;
  flag.store(0, std::memory_order_relaxed);
  Drain(WaitFd(what));
}

int ShmLane::WaitFd(Wait what) const {
  if (side_ == Side::kWorker) return worker_fd_;
  return what == Wait::kData ? data_fd_ : room_fd_;
}

}  // namespace psd::wire
