#include "net/shm_listener.h"

#include <openssl/crypto.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstring>
#include <optional>

#include "net/peer_auth.h"

namespace psd::server {

static_assert(peer_auth::kNonceBytes == wire::kShmNonceBytes, "the offers' nonces are what workers send back");

ShmSlot::Lease::~Lease() {
  if (slot_) slot_->Release();
}

ShmSlot::Lease& ShmSlot::Lease::operator=(Lease&& o) noexcept {
  if (this == &o) return *this;
  for (unsigned i = 0; i < kSegments; ++i) segments_[i] = std::move(o.segments_[i]);
  if (slot_) slot_->Release();
  slot_ = std::move(o.slot_);
  return *this;
}

ShmSlot::Lease ShmSlot::Acquire() {
  Lease lease;
  MutexLock lock(&mu_);
  if (!segments_[0]) return lease;
  ++leases_;
  lease.slot_ = shared_from_this();
  for (unsigned i = 0; i < kSegments; ++i) lease.segments_[i] = segments_[i];
  return lease;
}

void ShmSlot::Release() {
  MutexLock lock(&mu_);
  if (--leases_ == 0) released_.NotifyAll();
}

void ShmSlot::Set(std::shared_ptr<wire::SharedSegment> segment, std::shared_ptr<wire::SharedSegment> buffers,
                  std::shared_ptr<wire::ShmLane> lane) {
  MutexLock lock(&mu_);
  segments_[0] = std::move(segment);
  segments_[1] = std::move(buffers);
  lane_ = std::move(lane);
}

std::shared_ptr<wire::ShmLane> ShmSlot::TakeLane() {
  MutexLock lock(&mu_);
  return std::move(lane_);
}

bool ShmSlot::Revoke(std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  MutexLock lock(&mu_);
  for (auto& s : segments_) s.reset();
  while (leases_ > 0) {
    if (!released_.WaitUntil(&mu_, deadline) && leases_ > 0) return false;
  }
  return true;
}

void ShmSlot::Close() {
  MutexLock lock(&mu_);
  for (auto& s : segments_) s.reset();  // unmapped when the last lease goes
  lane_.reset();
}

ShmListener::ShmListener(asio::io_context& io, uint64_t max_bytes, int64_t timeout_ms)
    : io_(io), max_bytes_(max_bytes), timeout_ms_(timeout_ms), acceptor_(io) {}

Status ShmListener::Start() {
  auto random = peer_auth::NewNonce();
  if (!random.ok()) return random.status();
  static constexpr char kHex[] = "0123456789abcdef";
  name_ = "psd-shm-";
  for (size_t i = 0; i < 12; ++i) {
    auto b = static_cast<uint8_t>((*random)[i]);
    name_ += kHex[b >> 4];
    name_ += kHex[b & 15];
  }
  boost::system::error_code ec;
  asio::local::stream_protocol::endpoint ep(wire::AbstractSocketPath(name_));
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Unavailable("the shared-memory socket @" + name_ + ": " + ec.message());
  Accept();
  return Status::Ok();
}

void ShmListener::Stop() {
  boost::system::error_code ec;
  acceptor_.close(ec);
}

Result<std::string> ShmListener::Offer(uint64_t conn, std::shared_ptr<ShmSlot> slot) {
  auto nonce = peer_auth::NewNonce();
  if (!nonce.ok()) return nonce.status();
  MutexLock lock(&mu_);
  offers_[conn] = {*nonce, std::move(slot)};
  return *nonce;
}

void ShmListener::Withdraw(uint64_t conn) {
  MutexLock lock(&mu_);
  offers_.erase(conn);
}

void ShmListener::Accept() {
  acceptor_.async_accept(asio::make_strand(io_), [this](boost::system::error_code ec, Socket socket) {
    if (ec) {
      if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
      if (const int64_t quiet = refusal_log_.Allow(); quiet >= 0) {
        spdlog::warn("shared-memory socket @{}: accept failed: {} ({} more not logged)", name_, ec.message(), quiet);
      }
      // Out of descriptors, say: a pause, not a spin on a failing accept.
      if (!retry_) retry_ = std::make_unique<asio::steady_timer>(io_);
      retry_->expires_after(std::chrono::milliseconds(100));
      retry_->async_wait([this](boost::system::error_code wec) {
        if (!wec && acceptor_.is_open()) Accept();
      });
      return;
    }
    auto w = std::make_shared<Waiting>();
    w->socket = std::make_shared<Socket>(std::move(socket));
    waiting_.Admit(w, kMaxWaiting);  // the oldest waiting goes when kMaxWaiting wait
    Serve(w);
    if (acceptor_.is_open()) Accept();
  });
}

bool ShmListener::Waiting::Evict() {
  if (!waiting_flag.exchange(false)) return false;
  asio::post(socket->get_executor(), [s = socket] {
    boost::system::error_code ignored;
    s->close(ignored);  // its wait ends with an error: nothing is read from it
  });
  return true;
}

void ShmListener::Serve(std::shared_ptr<Waiting> w) {
  std::shared_ptr<Socket> socket = w->socket;
  auto timer = std::make_shared<asio::steady_timer>(socket->get_executor());
  timer->expires_after(std::chrono::milliseconds(timeout_ms_));
  timer->async_wait([w](boost::system::error_code ec) {
    if (!ec && w->waiting_flag.exchange(false)) w->socket->close(ec);  // nothing came in time
  });
  socket->async_wait(Socket::wait_read, [this, w, socket, timer](boost::system::error_code ec) {
    timer->cancel();
    if (ec || !w->waiting_flag.exchange(false)) return;  // closed (timed out, or made room for another)
    uint8_t message[wire::kShmAttachLaneBytes];
    size_t n = 0;
    auto fds = wire::ReceiveWithFds(socket->native_handle(), message, sizeof(message), &n);
    Status s = fds.status();
    bool attach = false;
    std::shared_ptr<wire::ShmLane> lane;  // asked for (kShmAttachLaneBytes) and made
    if (fds.ok() && n == wire::kShmRevokeBytes && fds->size() == 1 &&
        std::memcmp(message, wire::kShmRevokeMessage, n) == 0) {
      auto arena = wire::IdentifySegment((*fds)[0]);
      ::close((*fds)[0]);
      s = arena.status();
      if (arena.ok()) {
        int revoked = RevokeArena(*arena, nullptr);
        if (revoked > 0) spdlog::info("shared buffers revoked by their worker ({} connection(s))", revoked);
      }
    } else if (fds.ok() && (n == wire::kShmAttachBytes || n == wire::kShmAttachLaneBytes)) {
      attach = true;
      s = Attach(message, *fds, n == wire::kShmAttachLaneBytes ? &lane : nullptr);
    } else if (fds.ok()) {
      for (int fd : *fds) ::close(fd);
      s = InvalidArgument("a message of " + std::to_string(n) + " bytes is neither an attach nor a revoke");
    }
    if (!s.ok()) {
      refused_.fetch_add(1);
      if (const int64_t quiet = refusal_log_.Allow(); quiet >= 0) {
        spdlog::warn("shared-memory socket @{}: {}; that worker stays on TCP ({} more not logged)", name_, s.message(),
                     quiet);
      }
    }
    std::string answer = s.ok() ? "OK" : s.message().substr(0, 400);
    // With the values segment's read-only descriptor (a worker that reads none drops it) and the
    // lane's; a worker that asked for the lane is told which came (wire::kShmAnswerValues, ...).
    std::vector<int> answer_fds;
    if (s.ok() && attach && values_fd_ >= 0) {
      answer_fds.push_back(values_fd_);
      if (n == wire::kShmAttachLaneBytes) answer += wire::kShmAnswerValues;
    }
    if (lane) {
      for (int fd : lane->Fds()) answer_fds.push_back(fd);
      answer += wire::kShmAnswerLane;
    }
    // A few bytes into an empty socket buffer: written at once (a peer that never reads loses them).
    boost::system::error_code wec;
    socket->non_blocking(true, wec);
    if (!answer_fds.empty()) {
      Status sent = wire::SendWithFds(socket->native_handle(), answer.data(), answer.size(), answer_fds);
      if (!sent.ok()) spdlog::warn("shared-memory socket @{}: answering an attach: {}", name_, sent.message());
    } else {
      asio::write(*socket, asio::buffer(answer), wec);
    }
    socket->close(wec);
  });
}

Status ShmListener::Attach(const uint8_t* message, const std::vector<int>& fds, std::shared_ptr<wire::ShmLane>* lane) {
  const uint64_t conn = wire::ShmAttachConnection(message);
  std::shared_ptr<ShmSlot> slot;
  {
    MutexLock lock(&mu_);
    auto it = offers_.find(conn);
    bool match = it != offers_.end() && it->second.nonce.size() == wire::kShmNonceBytes &&
                 CRYPTO_memcmp(it->second.nonce.data(), message + 8, wire::kShmNonceBytes) == 0;
    if (match) {
      slot = it->second.slot.lock();
      offers_.erase(it);  // used once; a wrong nonce leaves it for its worker
    }
    if (!match || !slot) {
      for (int fd : fds) ::close(fd);
      return Unauthenticated("a segment for connection " + std::to_string(conn) +
                             " without its nonce (or that connection is gone): refused");
    }
  }
  std::optional<wire::SegmentId> arena;
  if (fds.size() > 1) {
    auto id = wire::IdentifySegment(fds[1]);
    if (!id.ok()) {
      for (int fd : fds) ::close(fd);
      return id.status();
    }
    arena = *id;
  }
  auto segment = wire::SharedSegment::Adopt(fds[0], max_bytes_);
  if (!segment.ok()) {
    if (fds.size() > 1) ::close(fds[1]);
    return segment.status();
  }
  std::shared_ptr<wire::SharedSegment> buffers;
  if (fds.size() > 1) {
    auto adopted = wire::SharedSegment::Adopt(fds[1], max_bytes_);
    if (!adopted.ok()) return Status(adopted.status().code(), "shared buffers: " + adopted.status().message());
    buffers = std::move(*adopted);
    // An arena attached again comes from a worker that left an earlier connection: that one
    // touches it no more (a request of it cut off could otherwise write into reused buffers).
    int revoked = RevokeArena(*arena, slot.get());
    if (revoked > 0) spdlog::info("connection {}: shared buffers revoked from its earlier connection", conn);
    MutexLock lock(&mu_);
    auto& slots = arenas_[*arena];
    std::erase_if(slots, [](const std::weak_ptr<ShmSlot>& w) { return w.expired(); });
    slots.push_back(slot);
  }
  const uint64_t bytes = (*segment)->size();
  const uint64_t buffer_bytes = buffers ? buffers->size() : 0;
  // The request lane, when asked for: without it (no memory, no descriptors) the requests stay on TCP.
  std::string lane_note;
  if (lane != nullptr) {
    auto made = wire::ShmLane::Create();
    if (made.ok()) {
      *lane = *made;
      lane_note = ", requests through it too";
    } else {
      spdlog::warn("connection {}: no shared-memory lane for its requests ({}); they stay on TCP", conn,
                   made.status().message());
    }
  }
  slot->Set(std::move(*segment), std::move(buffers), lane != nullptr ? *lane : nullptr);
  attached_.fetch_add(1);
  spdlog::info("connection {}: shared memory attached ({} MiB segment{}): its tensors move through it{}", conn,
               bytes >> 20,
               buffer_bytes > 0 ? ", " + std::to_string(buffer_bytes >> 20) + " MiB of shared buffers" : "", lane_note);
  return Status::Ok();
}

int ShmListener::RevokeArena(const wire::SegmentId& arena, const ShmSlot* keep) {
  std::vector<std::shared_ptr<ShmSlot>> revoke;
  {
    MutexLock lock(&mu_);
    auto it = arenas_.find(arena);
    if (it == arenas_.end()) return 0;
    std::vector<std::weak_ptr<ShmSlot>> kept;
    for (const auto& w : it->second) {
      auto s = w.lock();
      if (!s) continue;
      if (s.get() == keep) {
        kept.push_back(w);
      } else {
        revoke.push_back(std::move(s));
      }
    }
    if (kept.empty()) {
      arenas_.erase(it);
    } else {
      it->second = std::move(kept);
    }
  }
  // Outside mu_: a revoke waits for the requests that hold the pages (one add or copy each), up
  // to the attach timeout (a worker waits no longer for the answer).
  for (auto& s : revoke) {
    if (!s->Revoke(std::chrono::milliseconds(timeout_ms_))) {
      spdlog::warn("shared buffers revoked while a request still used them after {} ms: it may still touch them",
                   timeout_ms_);
    }
  }
  return static_cast<int>(revoke.size());
}

}  // namespace psd::server
