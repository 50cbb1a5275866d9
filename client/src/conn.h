// One connection from libpsclient to one daemon: connect and hello (TLS, auth token), framed
// requests and replies with deadlines, reconnects, frame-size limits and the same-host
// shared-memory segment. Internal to libpsclient (client.cc drives one per shard).
#ifndef PSCLIENT_SRC_CONN_H_
#define PSCLIENT_SRC_CONN_H_

#include <kj/exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "psclient/client.h"
#include "wire/frame.h"
#include "wire/shm.h"
#include "wire/shm_lane.h"
#include "wire/tls.h"

namespace psclient::internal {

class SharedArena;
namespace proto = psd::proto;
using psd::wire::InFrame;
using psd::wire::OutFrame;

// "300 MiB", "1.5 GiB", "4096 bytes" for size errors.
std::string HumanBytes(uint64_t bytes);

// The job's configuration as a hello reply states it.
JobConfig ReadConfig(proto::JobConfig::Reader c);

// A reply that Cap'n Proto could not read.
Status Malformed(const kj::Exception& e);

// One connection to one daemon (a shard of a cluster, or the only daemon). Blocking socket with
// poll deadlines; a request is sent with Send and its reply read with Receive, so a caller can
// send to every shard before reading any reply.
class Conn {
 public:
  // `arena`: the client's shared buffers (null: none), attached with the segment.
  Conn(const ClientOptions& options, std::string host, uint16_t port, int index, std::shared_ptr<SharedArena> arena)
      : options_(options), host_(std::move(host)), port_(port), index_(index), arena_(std::move(arena)), socket_(io_) {}

  // Connects and says hello. A daemon that answers UNAVAILABLE (restoring a checkpoint) is asked
  // again until connect_timeout_ms has passed.
  // `limit_ms` (0: connect_timeout_ms) bounds it.
  Status Connect(int64_t limit_ms = 0);

  // Resolve, connect and hello, all before `deadline` (connect_timeout_ms from the first try).
  Status ConnectOnce(std::chrono::steady_clock::time_point deadline);

  // After a hello: attaches a fresh shared-memory segment when the daemon offers one (then it is
  // on this host). Any failure leaves the connection on TCP and says why in shm_status.
  void AttachShm(proto::HelloReply::Reader hr, std::chrono::steady_clock::time_point deadline);

  proto::Request::Builder NewRequest(OutFrame& frame) {
    auto req = frame.builder.initRoot<proto::Request>();
    req.setId(++next_id_);
    return req;
  }

  // Sends `frame` (connecting first if needed). `wait_ms`: how long the daemon may legitimately
  // hold the reply (a token wait); the reply deadline is the longer of request_timeout_ms and
  // wait_ms + 10 s, counted from now.
  Status Send(OutFrame& frame, int64_t wait_ms = 0);

  // Reads the reply to `frame`; a non-OK reply becomes the returned Status. The reader stays
  // valid until the next Receive on this connection.
  // `landing`: where a one-tensor reply's data may be read straight to (psd::wire::Landing).
  Status Receive(OutFrame& frame, proto::Response::Reader* resp, const psd::wire::Landing* landing = nullptr);

  Status RoundTrip(OutFrame& frame, proto::Response::Reader* resp, int64_t wait_ms = 0) {
    PSD_RETURN_IF_ERROR(Send(frame, wait_ms));
    return Receive(frame, resp);
  }

  void Drop();
  // Connects to `host`:`port` from now on (a shard served by a stand-in after a takeover, or back
  // at its own address): drops the connection if it moves.
  void Retarget(const std::string& host, uint16_t port) {
    if (host == host_ && port == port_) return;
    Drop();
    host_ = host;
    port_ = port;
  }
  bool IsOpen() const { return tls_ ? tls_->next_layer().is_open() : socket_.is_open(); }

  // A request the daemon would refuse for its size fails here, before a byte is sent (the daemon
  // would close the connection mid-write, which reads as a retryable "Broken pipe").
  Status CheckFrameSize(OutFrame& frame);

  std::string Where() const { return host_ + ":" + std::to_string(port_); }
  const std::string& host() const { return host_; }
  uint16_t port() const { return port_; }

  // A cluster's shard: asked every kStallCheckMs while its reply is late whether to wait on;
  // non-OK (the cluster serves that shard elsewhere now, or counts it gone): the reply is given
  // up with that status and the connection reset. A hung host's process answers nothing and
  // closes nothing, so only the other shards can tell.
  std::function<Status()> stall_check;
  static constexpr int64_t kStallCheckMs = 1000;
  // Whether this connection's frames travel in a shared-memory lane (ClientOptions::shm_lane).
  bool on_lane() const { return lane_ != nullptr; }
  // Whether the last Receive got a reply from the daemon (else the connection failed).
  bool last_answered() const { return answered_; }
  int index() const { return index_; }

  // From the last handshake. A reconnect (on a call thread, under the client's call lock)
  // rewrites them: the Client's lock-free getters read config, worker_id and initial_step under
  // hello_mu, and connects is atomic.
  mutable std::mutex hello_mu;
  JobConfig config;          // guarded by hello_mu for writes and lock-free readers
  uint32_t worker_id = 0;    // guarded by hello_mu for writes and lock-free readers
  int64_t initial_step = 0;  // guarded by hello_mu for writes and lock-free readers
  bool is_chief = false;
  int chief_shard = 0;
  uint64_t cluster_epoch = 0;
  int shards_reported = 1;
  bool quick_reconnect = false;  // a cluster's shard (see Send)
  static constexpr int64_t kQuickReconnectMs = 500;
  uint64_t daemon_max_frame_bytes = 0;  // psd's --max-frame-bytes from the hello (0: not announced)
  uint64_t chunk_elements = 0;          // what gradient chunks align to (0: the daemon takes none)
  // psd's --max-queued-reply-bytes from the hello (0: not announced): psd reads no further request
  // from this connection while more reply bytes than that wait to be written to it.
  uint64_t daemon_reply_hold = 0;
  // The most reply bytes a batch (Client::Impl::Run) leaves unread on this connection when it sends
  // a request: half psd's hold, so psd never stops reading a request this client is still writing
  // (the client reads no reply while it writes).
  uint64_t ReplyWindow() const { return daemon_reply_hold > 0 ? daemon_reply_hold / 2 : kDefaultReplyWindow; }
  static constexpr uint64_t kDefaultReplyWindow = 32ull << 20;
  // What a reply may hold besides the values a call expects (Call::reply_bytes): ids, codes,
  // names, an error's text.
  static constexpr uint64_t kReplyOverhead = 1 << 10;
  static constexpr uint64_t kReplyValueOverhead = 256;  // ... and each value's name, shape, dtype
  // The reply buffer kept however small the recent replies (InFrame::MaybeRelease).
  static constexpr size_t kKeptReplyBytes = 16 << 20;
  // The most chunk_elements a hello may announce (a bigger one fails the connect as malformed).
  static constexpr uint64_t kMaxChunkElements = uint64_t{1} << 30;
  // Room for a frame's own words besides its tensors' bytes (names, shapes, list pointers): a
  // frame planned for push_frame_bytes / pull_frame_bytes of tensors may be this much bigger.
  static constexpr uint64_t kFrameSlack = 64 << 10;
  // The most a push frame carries: ClientOptions::push_frame_bytes of tensors, within
  // --max-frame-bytes (less room for the request's own words); 0: one frame.
  uint64_t PushFrameLimit() const;
  // The most bytes of an initial value one CreateVariable frame carries (a bigger one goes in
  // chunks of this size); 0: one frame (push_frame_bytes 0, or a daemon that takes no chunks).
  uint64_t CreateChunkBytes() const;
  // The most one pull reply carries: ClientOptions::pull_frame_bytes of tensors, within the
  // client's own max_frame_bytes (less room for the reply's own words); 0 when the daemon takes
  // no ranges, or pull_frame_bytes is 0: one reply.
  uint64_t PullFrameLimit() const;
  std::atomic<uint64_t> connects{0};
  std::atomic<uint64_t> requests{0};

  // Shared memory (AttachShm). Written on a call thread under the client's call lock and shm_mu;
  // the status getters read under shm_mu.
  mutable std::mutex shm_mu;
  std::shared_ptr<psd::wire::SharedSegment> shm;
  std::string shm_status = "not connected";
  // Why the frames stay on TCP though a lane was asked for (ClientOptions::shm_lane); empty otherwise.
  std::string lane_status;
  uint64_t shm_used = 0;  // bytes handed out by ShmReserve since ShmReset
  // Room for `bytes` (64-byte aligned) in the segment for this batch of requests, or -1.
  int64_t ShmReserve(uint64_t bytes);
  bool ShmFits(uint64_t bytes) const { return shm && psd::wire::ShmAlign(shm_used) + bytes <= shm->size(); }
  // The room left in the segment for this batch of requests (0: none, or no segment).
  uint64_t ShmRoom() const {
    return shm ? shm->size() - std::min<uint64_t>(shm->size(), psd::wire::ShmAlign(shm_used)) : 0;
  }
  // The most rows one PullRows request names (8 bytes each, and 8 more for an offset in shared
  // memory) within psd's --max-frame-bytes: replies in shared memory are not bound by a frame.
  uint64_t RowsPerRequest() const {
    const uint64_t limit = daemon_max_frame_bytes > 0 ? daemon_max_frame_bytes : options_.max_frame_bytes;
    return std::max<uint64_t>(1, (limit - std::min(limit, kFrameSlack)) / 16);
  }
  // ClientOptions::shm_piece_bytes where the daemon takes chunks and ranges, else 0 (one piece).
  uint64_t ShmPieceBytes() const { return chunk_elements == 0 ? 0 : options_.shm_piece_bytes; }
  // Every reply of the last batch is in: its room may be used again.
  void ShmReset() { shm_used = 0; }
  // Copies a tensor's bytes into the segment (room the caller checked with ShmFits) and says
  // where in `t`.
  void PutInShm(proto::Tensor::Builder t, DType dtype, const Shape& shape, const void* data, size_t bytes);
  // Says in `t` that the tensor is at `offset` of shared-memory segment `segment` (no copy).
  static void RefInShm(proto::Tensor::Builder t, DType dtype, const Shape& shape, unsigned segment, uint64_t offset);
  // Shared buffers (segment 1): attached with the segment, when the client has them and psd maps
  // that much (else buffers_status says why).
  bool buffers = false;
  std::string buffers_status;
  // Where [p, p + bytes) is in the shared buffers when this connection has them attached, else -1.
  int64_t BufferOffset(const void* p, uint64_t bytes) const;
  // The daemon's values segment (segment 2, mapped read-only), sent with the attach's answer: a
  // pull through shared memory may find its values there in place (ShmTarget.values). Null: none.
  std::shared_ptr<psd::wire::SharedSegment> values;
  // The values of this connection's current reply (the last one received), which named values in
  // the daemon's values segment, have been read: a one-way frame says so now (Request.valuesAck
  // with valuesRead), so psd lets go of the buffers it named and a worker that computes, or lags a
  // step, holds nothing meanwhile.
  void ValuesRead();
  // [offset, offset + bytes) of segment 0, 1 or 2, or nullptr.
  const uint8_t* ShmAt(unsigned segment, uint64_t offset, uint64_t bytes) const;
  // A tensor of a reply from this connection: in the frame (within max_frame_bytes), or where it
  // says in this connection's shared memory.
  Result<psd::wire::TensorRef> ReplyTensor(proto::Tensor::Reader t) const;

 private:
  Status SendNoReconnect(OutFrame& frame);
  // The frame's bytes, in the lane or on the socket (TLS or not), before `deadline`.
  Status WriteWhole(OutFrame& frame, psd::wire::Deadline deadline);
  // The lane (on_lane()): writes a frame, reads n bytes, each waiting for room or bytes before
  // deadline_ (ClientOptions::busy_poll_us spinning first).
  Status LaneWrite(OutFrame& frame, psd::wire::Deadline deadline);
  Status LaneRead(void* dst, size_t n);
  // Sleeps until the lane's doorbell rings or the TCP connection ends or has something (psd closed
  // it: UNAVAILABLE), each kStallCheckMs asking stall_check; DEADLINE_EXCEEDED past `deadline`.
  Status LaneWait(psd::wire::ShmLane::Wait what, psd::wire::Deadline deadline);
  // After an attach that brought a lane: moves this connection's frames onto it (Request.useLane
  // over TCP); false (the frames stay on TCP) if the frame could not be sent.
  bool StartLane(std::shared_ptr<psd::wire::ShmLane> lane, std::chrono::steady_clock::time_point deadline);
  // Plain TCP: waits until the socket has something to read (or the deadline), asking stall_check
  // (where set) each kStallCheckMs; its verdict if it says to give up. (TLS: ReadFrame asks.)
  Status WaitReadable();

  // Tells the daemon at shared-memory socket `socket_name` to touch the shared buffers no more
  // (a request of the dropped connection could still be running there).
  void RevokeBuffers(const std::string& socket_name);

  // Wraps the connected socket in TLS and shakes hands, verifying psd's certificate.
  Status StartTls(std::chrono::steady_clock::time_point deadline);

  const ClientOptions& options_;
  std::string host_;  // Retarget changes them (under the client's call lock)
  uint16_t port_;
  const int index_;
  const std::shared_ptr<SharedArena> arena_;
  std::string shm_socket_;      // psd's shared-memory socket, from the last attach
  uint64_t last_reply_id_ = 0;  // the reply Receive read last
  psd::asio::io_context io_;
  psd::tcp::socket socket_;
  std::shared_ptr<psd::wire::ssl::context> tls_context_;
  std::unique_ptr<psd::wire::ssl::stream<psd::tcp::socket>> tls_;  // set once TLS is up (then socket_ is unused)
  InFrame in_;
  psd::wire::ReadAhead ahead_;  // plain TCP: what the last read brought beyond its frame
  // This connection's frames travel in it (set: on_lane()). Written on a call thread under shm_mu
  // (AttachShm, Drop), read there without it and by the status getters under it.
  std::shared_ptr<psd::wire::ShmLane> lane_;
  std::unique_ptr<capnp::MessageReader> reader_;
  uint64_t next_id_ = 0;
  int64_t limit_ms_ = 0;
  psd::wire::Deadline deadline_{};
  bool answered_ = false;
};

// Prefixes a shard's error with where it came from (clusters only).
Status FromShard(const Status& s, const Conn& c, bool cluster);

}  // namespace psclient::internal

#endif  // PSCLIENT_SRC_CONN_H_
