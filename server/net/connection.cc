#include "net/connection.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <exception>
#include <new>

namespace psd::server {

bool Connection::DetectDeadPeer(int fd) {
  const int on = 1, idle = kKeepAliveIdleS, interval = kKeepAliveIntervalS, probes = kKeepAliveProbes;
  bool ok = ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on)) == 0;
  ok = ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle)) == 0 && ok;
  ok = ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval)) == 0 && ok;
  ok = ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes)) == 0 && ok;
  return ok;
}

Connection::Connection(tcp::socket socket, const ConnectionEnv& env, uint64_t id)
    : env_(env),
      stream_(std::move(socket), env.tls),
      strand_(asio::make_strand(static_cast<asio::io_context&>(stream_.get_executor().context()))),
      id_(id),
      in_(env.frame_buffers),
      frame_timer_(strand_),
      timer_(strand_) {}

void Connection::Start(std::shared_ptr<FrameHandler> handler) {
  handler_ = std::move(handler);
  boost::system::error_code ec;
  stream_.lowest().set_option(tcp::no_delay(true), ec);
  // Non-blocking for its own writes too (WriteNext tries each frame at once): a full socket
  // buffer then says so instead of blocking the I/O thread.
  if (!stream_.tls()) stream_.lowest().non_blocking(true, ec);
  if (!DetectDeadPeer(stream_.lowest().native_handle())) {
    spdlog::warn("connection {}: TCP keepalive could not be set; a peer whose host dies is not noticed", id_);
  }
  asio::dispatch(strand_, [self = shared_from_this()] {
    auto hello = std::chrono::milliseconds(self->env_.hello_timeout_ms);
    self->hello_deadline_ = std::chrono::steady_clock::now() + hello;
    self->ArmTimer(hello);  // bounds the TLS handshake too
    self->stream_.async_handshake(
        wire::ssl::stream_base::server, asio::bind_executor(self->strand_, [self](const boost::system::error_code& ec) {
          if (self->closed_) return;  // closed at the hello deadline (said so then)
          if (ec) {
            self->Warn(
                "TLS handshake failed: " +
                wire::TlsErrorText(ec, self->stream_.tls() ? self->stream_.tls_stream().native_handle() : nullptr) +
                "; closing it");
            return self->CloseNow();
          }
          self->ReadHeader();
        }));
  });
}

void Connection::ArmTimer(std::chrono::steady_clock::duration after) {
  timer_.expires_after(after);
  timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
    if (!ec) self->OnTimer();
  });
}

void Connection::OnTimer() {
  if (closed_) return;
  auto now = std::chrono::steady_clock::now();
  if (role_ == Role::kNone) {
    if (now < hello_deadline_) return ArmTimer(hello_deadline_ - now);
    Warn("no hello within --hello-timeout-ms " + std::to_string(env_.hello_timeout_ms) + "; closing it");
    return CloseNow();
  }
  int64_t idle_s = env_.idle_timeout_s;
  if (idle_s <= 0) return;
  auto idle = std::chrono::seconds(idle_s);
  // A parked wait, a reply being written and a frame on its way in are activity: idle counts from
  // their end (a reply's end is its last byte written, a frame's its last byte read).
  if (writing_ || handler_->Busy() || reading_body_ || awaiting_share_) last_frame_ = now;
  if (now - last_frame_ < idle) return ArmTimer(last_frame_ + idle - now);
  spdlog::warn("connection {}: idle for --idle-timeout-s {} s; closing it (a client reconnects on its next call)", id_,
               idle_s);
  CloseNow();
}

void Connection::Warn(const std::string& what) {
  int64_t suppressed = 0;
  if (untrusted() && env_.stranger_log != nullptr && (suppressed = env_.stranger_log->Allow()) < 0) return;
  spdlog::warn("connection {}: {}{}", id_, what, peer_auth::LogLimiter::SuppressedNote(suppressed));
}

bool Connection::Evict() {
  if (!awaiting_hello_.exchange(false)) return false;
  asio::post(strand_, [self = shared_from_this()] {
    if (self->closed_ || self->role_ != Role::kNone) return;  // it said hello meanwhile
    self->CloseNow();
  });
  return true;
}

void Connection::CloseGracefully() {
  asio::post(strand_, [self = shared_from_this()] {
    self->closing_ = true;
    if (!self->writing_) self->CloseNow();
  });
}

void Connection::CloseNow() {
  if (closed_) return;
  closed_ = true;
  awaiting_hello_ = false;
  timer_.cancel();
  frame_timer_.cancel();
  EndIdleOffer();
  ReleaseCharge();
  stream_.Close();
  if (handler_) {
    handler_->OnClosed();
    handler_.reset();  // it may hold this connection: no cycle outlives the close
  }
  // The body buffer's memory too, once the frame being handled (this may run inside it) is done
  // with it and no read lands in it any more: a closed connection may be kept a while (a parked
  // round's waiter holds its session) and must not keep a frame's memory outside the budget.
  asio::post(strand_, [self = shared_from_this()] { self->DropBufferIfClosed(); });
  // Replies not written by now never will be (one being written is dropped when its write ends).
  DropQueued();
}

void Connection::DropBufferIfClosed() {
  if (closed_ && !read_in_place_) in_.Release();
}

// --- reading ----------------------------------------------------------------------------------

template <typename F>
void Connection::FillAhead(size_t need, F then) {
  asio::async_read(stream_, asio::buffer(ahead_.Room(), ahead_.RoomBytes()), TransferAtLeast{need},
                   asio::bind_executor(strand_, [self = shared_from_this(), then = std::move(then)](
                                                    boost::system::error_code ec, size_t n) mutable {
                     if (ec) return self->ReadFailed(ec);
                     self->ahead_.Filled(n);
                     then();
                   }));
}

template <typename F>
void Connection::ReadExact(void* dst, size_t n, F then) {
  const size_t got = ahead_.Take(dst, n);  // then ahead_ is empty, or n bytes were held
  if (got == n) return then();
  auto* rest = static_cast<uint8_t*>(dst) + got;
  const size_t left = n - got;
  if (ahead_.Small(left)) {
    return FillAhead(left, [this, rest, left, then = std::move(then)]() mutable {
      ahead_.Take(rest, left);
      then();
    });
  }
  read_in_place_ = true;  // a body's rest lands in its buffer
  asio::async_read(stream_, asio::buffer(rest, left), TransferAll{},
                   asio::bind_executor(strand_, [self = shared_from_this(), then = std::move(then)](
                                                    boost::system::error_code ec, size_t) mutable {
                     self->read_in_place_ = false;
                     if (ec) {
                       self->ReadFailed(ec);
                       return self->DropBufferIfClosed();
                     }
                     then();
                   }));
}

void Connection::ReadFailed(const boost::system::error_code& ec) {
  NoteLaneBroken(ec);
  CloseNow();
}

void Connection::NoteLaneBroken(const boost::system::error_code& ec) {
  if (!closed_ && ec == LaneStream::Broken()) {
    Warn("its shared-memory lane holds an index no writer could have left (a scribbled page); closing it");
  }
}

Status Connection::UseLane(std::shared_ptr<wire::ShmLane> lane) {
  if (role_ != Role::kWorker || stream_.tls() || stream_.on_lane()) {
    return FailedPrecondition("a shared-memory lane is for a worker's plain TCP connection, once");
  }
  if (ahead_.held() > 0 || writing_ || !write_queue_.empty()) {
    return FailedPrecondition("useLane must be the last frame on TCP, sent with no reply outstanding");
  }
  try {
    stream_.UseLane(std::move(lane));
  } catch (const boost::system::system_error& e) {  // the io_context cannot watch its doorbells
    return Unavailable(std::string("the lane's doorbells: ") + e.what());
  }
  WatchSocket();
  return Status::Ok();
}

void Connection::WatchSocket() {
  auto on_readable = [self = shared_from_this()](boost::system::error_code ec) {
    if (self->closed_) return;
    if (!ec) {
      uint8_t byte;
      const size_t n = self->stream_.lowest().read_some(asio::buffer(&byte, 1), ec);
      if (!ec && n > 0) self->Warn("a byte on TCP after its requests moved to shared memory; closing it");
      // The worker closed its end: as over TCP, the requests it wrote before are read (and
      // answered, into a lane nobody reads), then the reads end and the connection closes.
      if (ec == asio::error::eof) return self->stream_.LanePeerGone();
    }
    self->CloseNow();  // the socket failed, or a stray byte
  };
  stream_.lowest().async_wait(tcp::socket::wait_read, asio::bind_executor(strand_, std::move(on_readable)));
}

void Connection::ReadHeader() {
  if (closed_ || closing_) return;
  if (TooManyQueued()) {
    read_paused_ = true;  // WriteNext reads on once the replies go out
    if (env_.on_reads_paused) env_.on_reads_paused();
    return;
  }
  ReadExact(first_, sizeof(first_), [this] {
    if (role_ == Role::kNone && !stream_.tls() && wire::LooksLikeTlsHandshake(first_, sizeof(first_))) {
      Warn(
          "a TLS handshake at a port that does not speak TLS: give the client no TLS settings, or start psd with "
          "--tls-cert-file and --tls-key-file; closing it");
      return CloseNow();  // an answer in psd's framing would mean nothing to a TLS client
    }
    uint32_t count = 0;
    size_t rest = 0;
    Status s = wire::ParseFirstWord(first_, &count, &rest);
    if (!s.ok()) return FailStream(s);
    if (untrusted() && count > kMaxSegmentsUntrusted) {
      // Refused before its segment table is read: small frames have a segment or two.
      return FailStream(ResourceExhausted("a message of " + std::to_string(count) + " segments " +
                                          (role_ == Role::kNone ? "before the hello" : "from an observer") +
                                          ": psd reads at most " + std::to_string(kMaxSegmentsUntrusted) +
                                          " segments per message from such a connection"));
    }
    ReadTable(count, rest);
  });
}

void Connection::ReadTable(uint32_t segment_count, size_t rest) {
  table_.assign(1 + rest / 4, 0);
  table_[0] = first_[1];
  if (rest == 0) return ReadBody(segment_count);
  ReadExact(table_.data() + 1, rest, [this, segment_count] { ReadBody(segment_count); });
}

void Connection::ReadBody(uint32_t segment_count) {
  std::vector<uint32_t> sizes;
  uint64_t total = 0;
  Status s = wire::ParseSegmentSizes(table_.data(), segment_count, env_.max_frame_bytes, &sizes, &total);
  if (!s.ok()) return FailStream(s);
  uint64_t bytes = total * sizeof(capnp::word);
  if (role_ == Role::kNone && bytes > kPreHelloFrameBytes) {
    // Nothing bigger than a hello is allocated for a peer that has not said who it is.
    return FailStream(ResourceExhausted(
        "a message of " + std::to_string(bytes) + " bytes before the hello: psd reads at most " +
        std::to_string(kPreHelloFrameBytes) + " bytes from a connection until its hello is accepted; say hello first"));
  }
  if (role_ == Role::kObserver && bytes > kPreHelloFrameBytes) {
    return FailStream(ResourceExhausted(
        "a message of " + std::to_string(bytes) + " bytes from an observer: tools' requests are at most " +
        std::to_string(kPreHelloFrameBytes) + " bytes; only workers and shards send bigger ones"));
  }
  body_sizes_ = std::move(sizes);
  body_words_ = total;
  WithdrawIdle();  // the kept buffer is about to be used (or replaced)
  // Workers' and shards' frames are charged to the budget. The others (before a hello, or from an
  // observer) are at most kPreHelloFrameBytes each, bounded by --max-connections, and never wait:
  // nobody who has not said hello can hold up a real worker.
  const bool charge = !untrusted();
  if (!charge || charged_ >= bytes) return ReadGrantedBody();  // a kept buffer is charged already
  ReleaseBuffer();                                             // a bigger one replaces it: never hold both
  awaiting_share_ = true;
  env_.budget->Acquire(bytes, [self = shared_from_this(), bytes] {
    asio::post(self->strand_, [self, bytes] {
      self->awaiting_share_ = false;
      self->charged_ = bytes;
      if (self->closed_) return self->ReleaseBuffer();
      self->ReadGrantedBody();
    });
  });
}

void Connection::ReadGrantedBody() {
  const size_t bytes = body_words_ * sizeof(capnp::word);
  capnp::word* body = nullptr;
  try {
    body = in_.Prepare(body_sizes_, body_words_);
  } catch (const std::bad_alloc&) {
    // Its budget share goes back at once: one frame the host cannot hold must not stall the rest.
    ReleaseBuffer();
    return FailStream(ResourceExhausted("psd could not allocate " + std::to_string(bytes) +
                                        " bytes for a frame (out of memory): send smaller frames, or give psd more "
                                        "memory or a smaller --max-inflight-bytes"));
  }
  if (ahead_.held() < bytes) {  // some of it is still to come: --frame-timeout-ms bounds the wait
    uint64_t gen = ++body_gen_;
    reading_body_ = true;
    frame_timer_.expires_after(std::chrono::milliseconds(env_.frame_timeout_ms));
    frame_timer_.async_wait([self = shared_from_this(), gen](boost::system::error_code ec) {
      if (ec || self->closed_ || !self->reading_body_ || gen != self->body_gen_) return;
      spdlog::warn("connection {}: a frame of {} bytes did not arrive within --frame-timeout-ms {}; closing it",
                   self->id_, self->body_words_ * sizeof(capnp::word), self->env_.frame_timeout_ms);
      if (self->env_.on_frame_timeout) self->env_.on_frame_timeout();
      self->CloseNow();
    });
  }
  ReadExact(body, bytes, [this] { OnBody(); });
}

void Connection::OnBody() {
  // Closed while the body's last read completed: nobody handles it, and its buffer goes now (a
  // parked waiter may keep this connection a while).
  if (closed_) return DropBufferIfClosed();
  if (reading_body_) {
    reading_body_ = false;
    frame_timer_.cancel();
  }
  if (env_.on_bytes_in) env_.on_bytes_in(body_words_ * sizeof(capnp::word) + table_.size() * 4 + 4);
  last_frame_ = std::chrono::steady_clock::now();
  if (handler_) {
    try {
      handler_->OnFrame(in_);
    } catch (const std::exception& e) {
      // The handler's own errors are replies; anything escaping it leaves the request's state
      // unknown: this connection closes, its buffer and share go back, and the others go on.
      spdlog::error("connection {}: unexpected error while handling a frame: {}", id_, e.what());
      CloseNow();
      return DropBufferIfClosed();
    }
  }
  in_.MaybeRelease(16u << 20);
  KeepOrReleaseBuffer();
  // The next frame may be held already: read it from a fresh handler, so that a run of small frames
  // read at once does not nest one call per frame.
  if (ahead_.held() > 0) return asio::post(strand_, [self = shared_from_this()] { self->ReadHeader(); });
  ReadHeader();
}

void Connection::KeepOrReleaseBuffer() {
  if (closed_ || charged_ == 0) return;
  if (in_.capacity_bytes() == 0) return ReleaseBuffer();
  // Kept for the next frame, but offered back: a buffer kept for reuse must not hold up a
  // connection waiting for its share (it is released when one waits, now or later). The offer
  // stays registered from frame to frame (idle_offered_ says whether the buffer is idle now), so a
  // frame costs the budget's lock nothing; a waiting Acquire takes every offer and runs it once,
  // and the next frame's end registers again.
  if (idle_registered_) {
    idle_offered_ = true;
    return;
  }
  std::weak_ptr<Connection> weak = weak_from_this();
  idle_registered_ = env_.budget->OfferIdle(id_, [weak] {
    auto self = weak.lock();
    if (!self) return;
    asio::post(self->strand_, [self] {
      self->idle_registered_ = false;    // taken by the Acquire that ran this
      if (!self->idle_offered_) return;  // in use again, or closed
      self->idle_offered_ = false;
      self->ReleaseBuffer();
    });
  });
  idle_offered_ = idle_registered_;
  if (!idle_registered_) ReleaseBuffer();  // someone waits already
}

void Connection::WithdrawIdle() {
  idle_offered_ = false;  // the registration stays for the next frame (KeepOrReleaseBuffer)
}

void Connection::EndIdleOffer() {
  idle_offered_ = false;
  if (!idle_registered_) return;
  idle_registered_ = false;
  env_.budget->Withdraw(id_);
}

void Connection::ReleaseBuffer() {
  in_.Release();
  ReleaseCharge();
}

void Connection::ReleaseCharge() {
  if (charged_ == 0) return;
  uint64_t bytes = charged_;
  charged_ = 0;
  env_.budget->Release(bytes);
}

void Connection::FailStream(const Status& status, uint64_t id) {
  Warn(status.ToString() + "; closing it");
  if (handler_) return SendAndClose(handler_->ErrorReply(id, status));
  CloseNow();
}

// --- writing ----------------------------------------------------------------------------------

bool Connection::TooManyQueued() const {
  return (untrusted() && write_queue_.size() > kMaxQueuedRepliesUntrusted) ||
         queued_bytes_ > env_.max_queued_reply_bytes;
}

void Connection::Send(std::shared_ptr<wire::OutFrame> frame, std::function<void()> on_unsent) {
  if (closed_) {
    RunOnUnsent(on_unsent);  // what it throws is logged: the frame is done with
    return;
  }
  const uint64_t bytes = frame->BodyBytes();
  write_queue_.push_back({std::move(frame), bytes, std::move(on_unsent)});  // queued, or nothing changed
  queued_bytes_ += bytes;
  if (!writing_) WriteNext();
}

void Connection::SendAndClose(std::shared_ptr<wire::OutFrame> frame) {
  closing_ = true;  // first: the frame is written asynchronously, and the close follows it (WriteNext)
  Send(std::move(frame));
  if (!writing_) CloseNow();
}

void Connection::WriteNext() {
  // Never throws: the caller's frame is queued (Send) and its fate is the connection's. Out of
  // memory for a write's buffer list or its completion, the connection closes, and what it did not
  // write is dropped (DropQueued).
  try {
    WriteQueued();
  } catch (const std::exception& e) {
    spdlog::error("connection {}: no memory to write a reply ({}); closing it", id_, e.what());
    writing_ = false;
    CloseNow();
    DropQueued();  // if it was closed already
  }
}

void Connection::WriteQueued() {
  for (;;) {
    if (closed_) {
      writing_ = false;
      return DropQueued();
    }
    if (write_queue_.empty()) {
      writing_ = false;
      if (closing_) CloseNow();
      return;
    }
    writing_ = true;
    std::shared_ptr<wire::OutFrame> frame = write_queue_.front().frame;
    std::vector<asio::const_buffer> buffers = frame->Buffers();
    size_t sent = 0;
    // Plain TCP (or its lane): the frame is offered to the socket from here first (one sendmsg; the socket is
    // non-blocking). A reply the socket's buffer takes whole, nearly every small one, is then done
    // with: an asynchronous write's completion is a handler queued behind the reply, and with it
    // queued the I/O thread looks at its sockets once more (an epoll_wait that finds nothing)
    // before it sleeps, one more system call per request. What the socket does not take, or an
    // error, goes the asynchronous way (which reports the error and closes, never from inside
    // whoever sent). Closing (SendAndClose), the writes stay asynchronous: the close follows them.
    if (!stream_.tls() && !closing_) {
      boost::system::error_code ec;
      sent = stream_.try_write_some(buffers, ec);
      if (ec) sent = 0;
      if (!ec && sent == asio::buffer_size(buffers)) {
        FrameWritten(ec, sent);
        if (read_paused_ && !TooManyQueued()) {
          // Resumed from a handler of its own, as after an asynchronous write: this may run inside
          // the handling of a frame.
          read_paused_ = false;
          asio::post(strand_, [self = shared_from_this()] { self->ReadHeader(); });
        }
        continue;
      }
      size_t skip = sent;
      for (auto& b : buffers) {
        size_t take = std::min(skip, b.size());
        b += take;
        skip -= take;
      }
    }
    asio::async_write(
        stream_, buffers, TransferAll{},
        asio::bind_executor(strand_, [self = shared_from_this(), frame, sent](boost::system::error_code ec, size_t n) {
          if (!self->FrameWritten(ec, sent + n)) return;
          self->WriteNext();
          if (self->read_paused_ && !self->TooManyQueued()) {
            self->read_paused_ = false;
            self->ReadHeader();
          }
        }));
    return;
  }
}

bool Connection::FrameWritten(const boost::system::error_code& ec, size_t n) {
  if (env_.on_bytes_out) env_.on_bytes_out(n);
  Queued written = std::move(write_queue_.front());
  write_queue_.pop_front();
  queued_bytes_ -= written.bytes;
  if (ec) {
    // Cut off: the peer never reads this frame whole, so it is dropped as the rest are.
    NoteLaneBroken(ec);
    writing_ = false;
    RunOnUnsent(written.on_unsent);
    CloseNow();
    DropQueued();  // if it was closed already (CloseNow drops them otherwise)
    return false;
  }
  last_frame_ = std::chrono::steady_clock::now();
  return true;
}

void Connection::DropQueued() {
  if (writing_) return;  // the front's write completes first (FrameWritten), then this runs again
  std::deque<Queued> dropped;
  dropped.swap(write_queue_);
  queued_bytes_ = 0;
  for (auto& q : dropped) {
    RunOnUnsent(q.on_unsent);
  }
}

void Connection::RunOnUnsent(const std::function<void()>& on_unsent) {
  if (!on_unsent) return;
  try {
    on_unsent();
  } catch (const std::exception& e) {
    spdlog::error("connection {}: undoing an unsent reply failed: {}", id_, e.what());
  }
}

}  // namespace psd::server
