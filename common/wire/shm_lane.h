// ShmLane: a same-host worker's requests and psd's replies as byte streams in shared memory
// (README "Same-host shared memory": the request lane). Two single-producer single-consumer byte
// rings in one segment, requests (worker to daemon) and replies (daemon to worker), and eventfd
// doorbells for a side that sleeps: a 4 KiB request then costs a copy into the ring and, when the
// other side sleeps, one eventfd write, instead of loopback TCP's send and receive paths.
//
// The daemon creates the lane (Create: a sealed memfd and three eventfds) for a worker that asks
// for it when it attaches its segment, and sends the descriptors with the attach's answer; the
// worker adopts them (Adopt). The worker then says so with one frame over TCP (Request.useLane),
// after which every frame of the connection, both ways, travels in the lane; the TCP connection
// stays open as the control path: its end is the peer's end.
//
// Trust: the daemon reads the worker's index of each ring (the request ring's tail, the reply
// ring's head) from pages the worker may scribble on at any moment. It keeps its own indices in
// private memory and only ever publishes them, copies bytes out before parsing them, and checks
// every index it reads against its own: one that claims more than the ring holds (or less than
// nothing) breaks the lane (broken()), and the daemon closes that connection. A worker that dies
// mid-frame leaves a partial frame the daemon never completes; its TCP connection's end closes the
// connection. A worker that rings the doorbells needlessly only makes psd look at its rings again.
//
// Thread-safety: one reader and one writer at a time on each side (a connection's strand, or the
// client's call lock); the read and write ends share nothing but broken().
#ifndef PSD_WIRE_SHM_LANE_H_
#define PSD_WIRE_SHM_LANE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "psd/status.h"
#include "wire/asio.h"
#include "wire/shm.h"

namespace psd::wire {

class ShmLane {
 public:
  enum class Side { kDaemon, kWorker };
  // What a side waits for: bytes to read, or room to write.
  enum class Wait { kData, kRoom };

  // Each ring's bytes (a power of two): a small frame and its reply, or a batch of them, fit whole;
  // bigger ones stream through. The segment is 4 KiB of indices and two rings.
  static constexpr uint64_t kDefaultRingBytes = 512 << 10;
  static constexpr uint64_t kMinRingBytes = 4096;
  static constexpr uint64_t kMaxRingBytes = 64 << 20;
  static constexpr uint64_t kHeaderBytes = 4096;
  // The descriptors Create sends and Adopt takes: the segment, the daemon's two doorbells (bytes
  // to read, room to write) and the worker's one.
  static constexpr size_t kFds = 4;

  // The daemon's side of a new lane.
  static Result<std::shared_ptr<ShmLane>> Create(uint64_t ring_bytes = kDefaultRingBytes);
  // The worker's side, from the kFds descriptors the daemon sent (taken: closed on failure too).
  static Result<std::shared_ptr<ShmLane>> Adopt(const std::vector<int>& fds);
  ~ShmLane();
  ShmLane(const ShmLane&) = delete;
  ShmLane& operator=(const ShmLane&) = delete;

  // The descriptors to send to the worker (Create's side; not owned by the caller), in Adopt's order.
  std::vector<int> Fds() const;
  uint64_t ring_bytes() const { return cap_; }
  Side side() const { return side_; }

  // Copies up to n bytes from this side's incoming ring (the daemon's requests, the worker's
  // replies); 0 when none are there (or the lane is broken). Rings the peer when it waits for room.
  size_t Read(void* dst, size_t n);
  // Copies as much of [first, last) as fits into this side's outgoing ring, from `skip` bytes into
  // it, and publishes it at once; rings the peer when it waits for bytes. 0 when full (or broken).
  size_t Write(const asio::const_buffer* first, const asio::const_buffer* last, size_t skip = 0);
  size_t Write(const void* data, size_t n) {
    asio::const_buffer b(data, n);
    return Write(&b, &b + 1);
  }
  // Bytes waiting in the incoming ring (0 when broken).
  size_t Readable();
  // The peer published an index this side can never have allowed: nothing more is read or written.
  bool broken() const { return broken_.load(std::memory_order_relaxed); }
  // Breaks it (a test's stand-in for a lying peer; the daemon's close).
  void Break() { broken_.store(true, std::memory_order_relaxed); }

  // About to sleep until `what`: says so to the peer, then looks again. False: it is there already
  // (or the lane broke): do not sleep (the flag is cleared). True: wait until WaitFd(what) is
  // readable, then FinishWait(what) and look again.
  bool PrepareWait(Wait what);
  void FinishWait(Wait what);
  int WaitFd(Wait what) const;

 private:
  struct Ring;  // one ring's indices and flags in the segment
  ShmLane(Side side, std::shared_ptr<SharedSegment> segment, uint64_t cap, int data_fd, int room_fd, int worker_fd);
  Ring* incoming() const;
  Ring* outgoing() const;
  uint8_t* incoming_bytes() const;
  uint8_t* outgoing_bytes() const;
  static void Knock(int fd);  // rings a doorbell
  static void Drain(int fd);  // empties a doorbell
  int peer_data_fd() const { return side_ == Side::kDaemon ? worker_fd_ : data_fd_; }
  int peer_room_fd() const { return side_ == Side::kDaemon ? worker_fd_ : room_fd_; }

  const Side side_;
  const std::shared_ptr<SharedSegment> segment_;
  const uint64_t cap_;
  const int data_fd_;    // the daemon sleeps on it for requests; the worker rings it
  const int room_fd_;    // the daemon sleeps on it for room for replies; the worker rings it
  const int worker_fd_;  // the worker sleeps on it for either; the daemon rings it
  // This side's own indices, never read back from the shared pages: the next byte to read from
  // the incoming ring, the next byte to write to the outgoing one.
  uint64_t read_at_ = 0;
  uint64_t write_at_ = 0;
  std::atomic<bool> broken_{false};
};

}  // namespace psd::wire

#endif  // PSD_WIRE_SHM_LANE_H_
