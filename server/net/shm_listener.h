// ShmListener: where same-host workers attach their shared-memory segments (README "Same-host
// shared memory"; the segment itself: common/wire/shm.h).
//
// The daemon listens on an abstract Unix socket ("psd-shm-<random>"), reachable only from its own
// host and network namespace. A worker's hello is answered with that name, the connection's id and
// a fresh one-time nonce (over the worker's TCP connection, after its auth token was checked: TLS
// keeps it private too). The worker connects to the socket and sends (id, nonce) with its segment's
// descriptor; the listener checks the nonce (constant time), maps the segment and puts it in that
// connection's ShmSlot, then answers "OK" (or why not, and the worker stays on TCP). A worker that
// asks for it (wire::kShmAttachLaneBytes) also gets a request lane (common/wire/shm_lane.h), made
// here, kept in the slot and sent with the answer. An offer is
// used once, by its right nonce: a wrong one (256 random bits are not guessed) leaves it in place,
// so that a local process sending guesses cannot push workers onto TCP.
//
// Anyone on the host may connect to the socket (its name is listed in /proc/net/unix): at most
// kMaxWaiting connections wait for their message at once, a new one closing the one that has
// waited longest (a worker sends its message as soon as it connects), refusals are logged at a
// bounded rate, and a failing accept (out of descriptors) is retried after a pause, not at once.
//
// Thread-safety: Offer/Withdraw/counters from any thread (mu_); accepts run on the io_context.
#ifndef PSD_SERVER_NET_SHM_LISTENER_H_
#define PSD_SERVER_NET_SHM_LISTENER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "base/waiting_queue.h"
#include "net/peer_auth.h"
#include "psd/status.h"
#include "wire/asio.h"
#include "wire/shm.h"
#include "wire/shm_lane.h"

namespace psd::server {

// A connection's attached segments: its own (segment 0) and, when the worker has shared buffers,
// their arena (segment 1; Tensor.shmSegment). A request reads or writes the pages only while it
// holds a Lease, taken for that request alone (never across a wait). Revoke waits for the leases
// held, then lets the segments go: from then on nothing of this connection touches them.
class ShmSlot : public std::enable_shared_from_this<ShmSlot> {
 public:
  static constexpr unsigned kSegments = 2;

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept : slot_(std::move(o.slot_)) {
      for (unsigned i = 0; i < kSegments; ++i) segments_[i] = std::move(o.segments_[i]);
    }
    Lease& operator=(Lease&& o) noexcept;
    Lease(const Lease&) = delete;
    ~Lease();
    // Segment `i`, or nullptr (none attached, revoked, or no such segment).
    wire::SharedSegment* segment(uint64_t i) const { return i < kSegments ? segments_[i].get() : nullptr; }
    // The same, shared: it stays mapped while this is kept (not counted as a lease: a revoke does
    // not wait for it).
    std::shared_ptr<wire::SharedSegment> shared_segment(uint64_t i) const {
      return i < kSegments ? segments_[i] : nullptr;
    }
    bool held() const { return slot_ != nullptr; }

   private:
    friend class ShmSlot;
    std::shared_ptr<ShmSlot> slot_;
    std::shared_ptr<wire::SharedSegment> segments_[kSegments];
  };

  // A lease on what is attached now (not held when nothing is, or after Revoke/Close).
  Lease Acquire() EXCLUDES(mu_);
  // The worker's segments, from its attach (buffers: may be null), and the lane made for it (null:
  // none asked for, or none could be made).
  void Set(std::shared_ptr<wire::SharedSegment> segment, std::shared_ptr<wire::SharedSegment> buffers,
           std::shared_ptr<wire::ShmLane> lane = nullptr) EXCLUDES(mu_);
  // The lane, once (Request.useLane moves the connection onto it); null when there is none.
  std::shared_ptr<wire::ShmLane> TakeLane() EXCLUDES(mu_);
  // No new leases; returns once the leases held are given back (true), or after `limit` with a
  // lease still held (false: a request stuck mid-copy may still touch the pages).
  bool Revoke(std::chrono::milliseconds limit) EXCLUDES(mu_);
  // The connection is gone: no new leases (those held finish, then the pages are unmapped).
  void Close() EXCLUDES(mu_);

 private:
  void Release() EXCLUDES(mu_);

  mutable Mutex mu_;
  CondVar released_;
  std::shared_ptr<wire::SharedSegment> segments_[kSegments] GUARDED_BY(mu_);
  int leases_ GUARDED_BY(mu_) = 0;
  std::shared_ptr<wire::ShmLane> lane_ GUARDED_BY(mu_);
};

class ShmListener {
 public:
  // Segments bigger than max_bytes are refused; a worker that connects must send its segment
  // within timeout_ms.
  ShmListener(asio::io_context& io, uint64_t max_bytes, int64_t timeout_ms);
  // Binds the abstract socket under a fresh random name and accepts.
  Status Start();
  void Stop();
  // A read-only descriptor of the daemon's values segment (service/values_segment.h; not owned),
  // sent with every attach's "OK": the worker maps it and reads pulled values in place. Before Start.
  void SetValuesDescriptor(int fd) { values_fd_ = fd; }
  const std::string& name() const { return name_; }

  // The one-time nonce with which connection `conn` may attach a segment to `slot`.
  Result<std::string> Offer(uint64_t conn, std::shared_ptr<ShmSlot> slot) EXCLUDES(mu_);
  void Withdraw(uint64_t conn) EXCLUDES(mu_);

  uint64_t attached() const { return attached_.load(); }
  uint64_t refused() const { return refused_.load(); }

 private:
  using Socket = asio::local::stream_protocol::socket;
  static constexpr size_t kMaxWaiting = 64;
  // A connection waiting for its message.
  struct Waiting {
    std::shared_ptr<Socket> socket;
    std::atomic<bool> waiting_flag{true};  // false once its message is being handled, or it was closed
    bool waiting() const { return waiting_flag.load(); }
    // Closes it (on its strand) if it still waits for its message.
    bool Evict();
  };
  void Accept();
  void Serve(std::shared_ptr<Waiting> w);
  // Checks the message, maps the segment(s) and fills the slot; the answer's text.
  // `lane` (non-null: the worker asked for one) gets the request lane made for it.
  Status Attach(const uint8_t* message, const std::vector<int>& fds, std::shared_ptr<wire::ShmLane>* lane)
      EXCLUDES(mu_);
  // Revokes every slot that holds the arena `fd` maps (but `keep`): a worker's earlier connections.
  int RevokeArena(const wire::SegmentId& arena, const ShmSlot* keep) EXCLUDES(mu_);

  asio::io_context& io_;
  const uint64_t max_bytes_;
  const int64_t timeout_ms_;
  int values_fd_ = -1;
  std::string name_;
  asio::local::stream_protocol::acceptor acceptor_;
  struct Pending {
    std::string nonce;
    std::weak_ptr<ShmSlot> slot;
  };
  Mutex mu_;
  std::map<uint64_t, Pending> offers_ GUARDED_BY(mu_);
  // The slots that map each worker's shared-buffer arena (one per connection it attached from).
  std::map<wire::SegmentId, std::vector<std::weak_ptr<ShmSlot>>> arenas_ GUARDED_BY(mu_);
  WaitingQueue<Waiting> waiting_;              // connections waiting for their message
  std::unique_ptr<asio::steady_timer> retry_;  // a failed accept's pause
  peer_auth::LogLimiter refusal_log_{5, std::chrono::seconds(10)};
  std::atomic<uint64_t> attached_{0};
  std::atomic<uint64_t> refused_{0};
};

}  // namespace psd::server

#endif  // PSD_SERVER_NET_SHM_LISTENER_H_
