// ShmListener: where same-host workers attach their shared-memory segments (README "Same-host
// shared memory"; the segment itself: common/wire/shm.h).
//
// The daemon listens on an abstract Unix socket ("psd-shm-<random>"), reachable only from its own
// host and network namespace. A worker's hello is answered with that name, the connection's id and
// a fresh one-time nonce (over the worker's TCP connection, after its auth token was checked: TLS
// keeps it private too). The worker connects to the socket and sends (id, nonce) with its segment's
// descriptor; the listener checks the nonce (constant time), maps the segment and puts it in that
// connection's ShmSlot, then answers "OK" (or why not, and the worker stays on TCP). An offer is
// used once, right or wrong: a guess costs the guesser its only try, and the connection falls
// back to TCP.
//
// Thread-safety: Offer/Withdraw/counters from any thread (mu_); accepts run on the io_context.
#ifndef PSD_SERVER_NET_SHM_LISTENER_H_
#define PSD_SERVER_NET_SHM_LISTENER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "base/mutex.h"
#include "psd/status.h"
#include "wire/asio.h"
#include "wire/shm.h"

namespace psd::server {

// A connection's attached segment (none until the worker attaches one). The session reads it per
// request and holds the shared_ptr while it reads or writes the pages.
class ShmSlot {
 public:
  std::shared_ptr<wire::SharedSegment> get() const EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return segment_;
  }
  void set(std::shared_ptr<wire::SharedSegment> s) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    segment_ = std::move(s);
  }

 private:
  mutable Mutex mu_;
  std::shared_ptr<wire::SharedSegment> segment_ GUARDED_BY(mu_);
};

class ShmListener {
 public:
  // Segments bigger than max_bytes are refused; a worker that connects must send its segment
  // within timeout_ms.
  ShmListener(asio::io_context& io, uint64_t max_bytes, int64_t timeout_ms);
  // Binds the abstract socket under a fresh random name and accepts.
  Status Start();
  void Stop();
  const std::string& name() const { return name_; }

  // The one-time nonce with which connection `conn` may attach a segment to `slot`.
  Result<std::string> Offer(uint64_t conn, std::shared_ptr<ShmSlot> slot) EXCLUDES(mu_);
  void Withdraw(uint64_t conn) EXCLUDES(mu_);

  uint64_t attached() const { return attached_.load(); }
  uint64_t refused() const { return refused_.load(); }

 private:
  using Socket = asio::local::stream_protocol::socket;
  void Accept();
  void Serve(std::shared_ptr<Socket> socket);
  // Checks the message, maps the segment and fills the slot; the answer's text.
  Status Attach(const uint8_t* message, int fd) EXCLUDES(mu_);

  asio::io_context& io_;
  const uint64_t max_bytes_;
  const int64_t timeout_ms_;
  std::string name_;
  asio::local::stream_protocol::acceptor acceptor_;
  struct Pending {
    std::string nonce;
    std::weak_ptr<ShmSlot> slot;
  };
  Mutex mu_;
  std::map<uint64_t, Pending> offers_ GUARDED_BY(mu_);
  std::atomic<uint64_t> attached_{0};
  std::atomic<uint64_t> refused_{0};
};

}  // namespace psd::server

#endif  // PSD_SERVER_NET_SHM_LISTENER_H_
