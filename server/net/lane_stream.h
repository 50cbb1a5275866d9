// LaneStream: a worker connection's bytes through its shared-memory lane (common/wire/shm_lane.h),
// behind the asynchronous read_some/write_some that Asio's composed operations call, as a socket's.
// ByteStream switches to it when the worker asks (Request.useLane); the TCP socket stays open
// beside it.
//
// A read or write that finds nothing to do says so to the worker (ShmLane::PrepareWait) and waits
// for the lane's doorbell (an eventfd) in the io_context, then tries again. Completions run on the
// handler's own executor (the connection's strand), posted, never from inside the call. A lane the
// worker broke (an impossible index) fails the operation: the connection closes.
//
// Thread-safety: as a socket's: one read and one write outstanding at a time, on one strand.
#ifndef PSD_SERVER_NET_LANE_STREAM_H_
#define PSD_SERVER_NET_LANE_STREAM_H_

#include <memory>
#include <utility>

#include "wire/asio.h"
#include "wire/shm_lane.h"

namespace psd::server {

class LaneStream {
 public:
  // `lane`: the daemon's side. Its doorbells are waited on as descriptors of `ex`'s context,
  // registered there and never closed here (the lane owns them: Close and the destructor release
  // them). Throws if the io_context cannot watch them.
  LaneStream(asio::any_io_executor ex, std::shared_ptr<wire::ShmLane> lane)
      : lane_(std::move(lane)),
        data_bell_(ex, lane_->WaitFd(wire::ShmLane::Wait::kData)),
        room_bell_(ex, lane_->WaitFd(wire::ShmLane::Wait::kRoom)) {}
  ~LaneStream() { Release(); }
  LaneStream(const LaneStream&) = delete;
  LaneStream& operator=(const LaneStream&) = delete;

  // What a broken lane's operations fail with.
  static boost::system::error_code Broken() { return asio::error::make_error_code(asio::error::fault); }

  template <typename Buffers, typename Handler>
  void async_read_some(const Buffers& buffers, Handler&& handler) {
    asio::mutable_buffer into = First<asio::mutable_buffer>(buffers);
    for (;;) {
      const size_t n = into.size() == 0 ? 0 : lane_->Read(into.data(), into.size());
      if (n > 0 || into.size() == 0) return Complete(std::forward<Handler>(handler), {}, n);
      if (lane_->broken() || !data_bell_.is_open()) return Complete(std::forward<Handler>(handler), Broken(), 0);
      if (peer_gone_) return Complete(std::forward<Handler>(handler), asio::error::eof, 0);  // all read
      if (lane_->PrepareWait(wire::ShmLane::Wait::kData)) break;
    }
    auto ex = asio::get_associated_executor(handler, data_bell_.get_executor());
    data_bell_.async_wait(asio::posix::descriptor_base::wait_read,
                          asio::bind_executor(ex, [this, buffers, h = std::forward<Handler>(handler)](
                                                      boost::system::error_code ec) mutable {
                            lane_->FinishWait(wire::ShmLane::Wait::kData);
                            // PeerGone cancels the wait: what the worker wrote before is still read.
                            if (ec && !(ec == asio::error::operation_aborted && peer_gone_)) return h(ec, 0);
                            async_read_some(buffers, std::move(h));
                          }));
  }

  template <typename Buffers, typename Handler>
  void async_write_some(const Buffers& buffers, Handler&& handler) {
    for (;;) {
      boost::system::error_code ec;
      const size_t n = try_write_some(buffers, ec);
      if (n > 0 || asio::buffer_size(buffers) == 0) return Complete(std::forward<Handler>(handler), {}, n);
      if (ec != asio::error::would_block) return Complete(std::forward<Handler>(handler), ec, 0);
      if (lane_->PrepareWait(wire::ShmLane::Wait::kRoom)) break;
    }
    auto ex = asio::get_associated_executor(handler, room_bell_.get_executor());
    room_bell_.async_wait(asio::posix::descriptor_base::wait_read,
                          asio::bind_executor(ex, [this, buffers, h = std::forward<Handler>(handler)](
                                                      boost::system::error_code ec) mutable {
                            lane_->FinishWait(wire::ShmLane::Wait::kRoom);
                            if (ec) return h(ec, 0);
                            async_write_some(buffers, std::move(h));
                          }));
  }

  // Writes what fits now (would_block: nothing did).
  template <typename Buffers>
  size_t try_write_some(const Buffers& buffers, boost::system::error_code& ec) {
    ec = {};
    if (lane_->broken() || !room_bell_.is_open()) {
      ec = Broken();
      return 0;
    }
    // Gathered into one publish (the worker wakes once for a whole frame).
    asio::const_buffer parts[kMaxParts];
    size_t count = 0;
    for (auto it = asio::buffer_sequence_begin(buffers); it != asio::buffer_sequence_end(buffers); ++it) {
      if (count == kMaxParts) break;
      parts[count++] = asio::const_buffer(*it);
    }
    const size_t n = lane_->Write(parts, parts + count);
    if (n == 0) ec = lane_->broken() ? Broken() : asio::error::make_error_code(asio::error::would_block);
    return n;
  }

  // The worker closed its end (its TCP connection): the frames it wrote before are read, then reads
  // end (eof) instead of waiting; a write waiting for room fails (operation_aborted).
  void PeerGone() {
    peer_gone_ = true;
    boost::system::error_code ec;
    data_bell_.cancel(ec);
    room_bell_.cancel(ec);
  }

  // Cancels the waits (their handlers see operation_aborted) and lets go of the doorbells.
  void Close() {
    Release();
    lane_->Break();
  }

 private:
  static constexpr size_t kMaxParts = 64;  // a frame's table and segments; more go in the next write

  void Release() {
    if (data_bell_.is_open()) data_bell_.release();
    if (room_bell_.is_open()) room_bell_.release();
  }

  template <typename Buffer, typename Buffers>
  static Buffer First(const Buffers& buffers) {
    for (auto it = asio::buffer_sequence_begin(buffers); it != asio::buffer_sequence_end(buffers); ++it) {
      Buffer b(*it);
      if (b.size() > 0) return b;
    }
    return Buffer();
  }

  template <typename Handler>
  void Complete(Handler&& handler, boost::system::error_code ec, size_t n) {
    auto ex = asio::get_associated_executor(handler, data_bell_.get_executor());
    asio::post(ex, [h = std::forward<Handler>(handler), ec, n]() mutable { h(ec, n); });
  }

  const std::shared_ptr<wire::ShmLane> lane_;
  asio::posix::stream_descriptor data_bell_;
  asio::posix::stream_descriptor room_bell_;
  bool peer_gone_ = false;  // PeerGone
};

}  // namespace psd::server

#endif  // PSD_SERVER_NET_LANE_STREAM_H_
