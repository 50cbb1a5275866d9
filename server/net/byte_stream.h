// ByteStream: a connection's byte stream, plain TCP or TLS over it, behind one interface that
// Asio's composed operations (async_read, async_write) accept. The TLS choice is made once, when
// the daemon starts (--tls-cert-file): a TLS daemon speaks only TLS.
//
// A same-host worker's plain TCP connection may move to its shared-memory lane (UseLane): from then
// on reads and writes go through the lane, and the socket stays open, unread, as the control path.
//
// Thread-safety: as Asio's sockets: one outstanding read and one outstanding write at a time,
// handlers on the caller's strand.
#ifndef PSD_SERVER_NET_BYTE_STREAM_H_
#define PSD_SERVER_NET_BYTE_STREAM_H_

#include <memory>
#include <optional>
#include <utility>

#include "net/lane_stream.h"
#include "wire/asio.h"
#include "wire/tls.h"

namespace psd::server {

// The completion condition of a connection's reads and writes: all of the buffers, each system
// call taking as much as the kernel will. Asio's default (transfer_all, and transfer_exactly and
// transfer_at_least alike) hands every read_some and write_some at most 64 KiB, so a 64 MiB push
// or reply took a thousand recvmsg or sendmsg calls, each after its own epoll wake-up.
struct TransferAll {
  size_t operator()(const boost::system::error_code& ec, size_t /*transferred*/) const {
    return ec ? 0 : size_t{1} << 30;
  }
};
// TransferAll that returns as soon as `at_least` bytes are in (the read-ahead's fill).
struct TransferAtLeast {
  size_t at_least;
  size_t operator()(const boost::system::error_code& ec, size_t transferred) const {
    return ec || transferred >= at_least ? 0 : size_t{1} << 30;
  }
};

class ByteStream {
 public:
  using executor_type = tcp::socket::executor_type;

  // `tls` null: plain TCP.
  ByteStream(tcp::socket socket, const std::shared_ptr<wire::ssl::context>& tls) {
    if (tls) {
      tls_context_ = tls;
      tls_.emplace(std::move(socket), *tls);
    } else {
      plain_.emplace(std::move(socket));
    }
  }

  executor_type get_executor() { return lowest().get_executor(); }
  tcp::socket& lowest() { return tls_ ? tls_->next_layer() : *plain_; }
  bool tls() const { return tls_.has_value(); }
  // The TLS stream (tls() only), e.g. for a client's server name.
  wire::ssl::stream<tcp::socket>& tls_stream() { return *tls_; }

  // The TLS handshake as `type` (plain TCP: none, `handler` runs at once with success, posted to
  // its own executor: a handler bound to a strand runs on that strand, as a TLS one does).
  template <typename Handler>
  void async_handshake(wire::ssl::stream_base::handshake_type type, Handler&& handler) {
    if (tls_) return tls_->async_handshake(type, std::forward<Handler>(handler));
    auto ex = asio::get_associated_executor(handler, get_executor());
    asio::post(ex, [h = std::forward<Handler>(handler)]() mutable { h(boost::system::error_code()); });
  }

  // Reads and writes go through `lane` from now on (plain TCP only).
  void UseLane(std::shared_ptr<wire::ShmLane> lane) { lane_.emplace(lowest().get_executor(), std::move(lane)); }
  bool on_lane() const { return lane_.has_value(); }
  // On a lane: the peer closed the socket; what it wrote in the lane is still read (LaneStream::PeerGone).
  void LanePeerGone() {
    if (lane_) lane_->PeerGone();
  }

  // Plain TCP or the lane: writes what the socket (non-blocking) or the lane takes now; would_block
  // when nothing.
  template <typename Buffers>
  size_t try_write_some(const Buffers& buffers, boost::system::error_code& ec) {
    if (lane_) return lane_->try_write_some(buffers, ec);
    return plain_->write_some(buffers, ec);
  }

  template <typename Buffers, typename Handler>
  void async_read_some(const Buffers& buffers, Handler&& handler) {
    if (lane_) return lane_->async_read_some(buffers, std::forward<Handler>(handler));
    if (tls_) return tls_->async_read_some(buffers, std::forward<Handler>(handler));
    plain_->async_read_some(buffers, std::forward<Handler>(handler));
  }

  template <typename Buffers, typename Handler>
  void async_write_some(const Buffers& buffers, Handler&& handler) {
    if (lane_) return lane_->async_write_some(buffers, std::forward<Handler>(handler));
    if (tls_) return tls_->async_write_some(buffers, std::forward<Handler>(handler));
    plain_->async_write_some(buffers, std::forward<Handler>(handler));
  }

  // Shuts the socket down and closes it (no TLS close_notify: the other side sees a reset).
  void Close() {
    if (lane_) lane_->Close();
    boost::system::error_code ec;
    lowest().shutdown(tcp::socket::shutdown_both, ec);
    lowest().close(ec);
  }

 private:
  std::shared_ptr<wire::ssl::context> tls_context_;  // declared first: outlives tls_
  std::optional<tcp::socket> plain_;
  std::optional<wire::ssl::stream<tcp::socket>> tls_;
  std::optional<LaneStream> lane_;  // after UseLane
};

}  // namespace psd::server

#endif  // PSD_SERVER_NET_BYTE_STREAM_H_
