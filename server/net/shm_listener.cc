#include "net/shm_listener.h"

#include <openssl/crypto.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstring>

#include "net/peer_auth.h"

namespace psd::server {

static_assert(peer_auth::kNonceBytes == wire::kShmNonceBytes, "the offers' nonces are what workers send back");

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
      spdlog::warn("shared-memory socket @{}: accept failed: {}", name_, ec.message());
    } else {
      Serve(std::make_shared<Socket>(std::move(socket)));
    }
    if (acceptor_.is_open()) Accept();
  });
}

void ShmListener::Serve(std::shared_ptr<Socket> socket) {
  auto timer = std::make_shared<asio::steady_timer>(socket->get_executor());
  timer->expires_after(std::chrono::milliseconds(timeout_ms_));
  timer->async_wait([socket](boost::system::error_code ec) {
    if (!ec) socket->close(ec);  // nothing came in time
  });
  socket->async_wait(Socket::wait_read, [this, socket, timer](boost::system::error_code ec) {
    timer->cancel();
    if (ec) return;
    uint8_t message[wire::kShmAttachBytes];
    auto fd = wire::ReceiveWithFd(socket->native_handle(), message, sizeof(message));
    Status s = fd.ok() ? Attach(message, *fd) : fd.status();
    if (!s.ok()) {
      refused_.fetch_add(1);
      spdlog::warn("shared-memory socket @{}: {}; that worker stays on TCP", name_, s.message());
    }
    std::string answer = s.ok() ? "OK" : s.message().substr(0, 400);
    // A few bytes into an empty socket buffer: written at once (a peer that never reads loses them).
    boost::system::error_code wec;
    socket->non_blocking(true, wec);
    asio::write(*socket, asio::buffer(answer), wec);
    socket->close(wec);
  });
}

Status ShmListener::Attach(const uint8_t* message, int fd) {
  const uint64_t conn = wire::ShmAttachConnection(message);
  std::shared_ptr<ShmSlot> slot;
  {
    MutexLock lock(&mu_);
    auto it = offers_.find(conn);
    bool match = it != offers_.end() && it->second.nonce.size() == wire::kShmNonceBytes &&
                 CRYPTO_memcmp(it->second.nonce.data(), message + 8, wire::kShmNonceBytes) == 0;
    if (it != offers_.end()) {
      slot = match ? it->second.slot.lock() : nullptr;
      offers_.erase(it);  // one try, right or wrong
    }
    if (!match || !slot) {
      ::close(fd);
      return Unauthenticated("a segment for connection " + std::to_string(conn) +
                             " without its nonce (or that connection is gone): refused");
    }
  }
  auto segment = wire::SharedSegment::Adopt(fd, max_bytes_);
  if (!segment.ok()) return segment.status();
  const uint64_t bytes = (*segment)->size();
  slot->set(std::move(*segment));
  attached_.fetch_add(1);
  spdlog::info("connection {}: shared memory attached ({} MiB segment): its tensors move through it", conn,
               bytes >> 20);
  return Status::Ok();
}

}  // namespace psd::server
