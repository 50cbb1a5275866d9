#include "conn.h"

#include <capnp/dynamic.h>
#include <kj/exception.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <thread>

#include "connect.h"
#include "shared_arena.h"

namespace psclient::internal {

std::string HumanBytes(uint64_t bytes) {
  static const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return std::to_string(bytes) + " bytes";
  double v = static_cast<double>(bytes);
  int u = -1;
  while (v >= 1024 && u < 3) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof(buf), v == static_cast<double>(static_cast<uint64_t>(v)) ? "%.0f %s" : "%.1f %s", v,
                kUnits[u]);
  return buf;
}

JobConfig ReadConfig(proto::JobConfig::Reader c) {
  JobConfig cfg;
  cfg.replicas_to_aggregate = c.getReplicasToAggregate();
  cfg.total_replicas = c.getTotalReplicas();
  cfg.tokens_per_step = c.getTokensPerStep();
  cfg.init_tokens = c.getInitTokens();
  cfg.optimizer = c.getOptimizer();
  cfg.learning_rate = c.getLearningRate();
  cfg.reduction_sum = c.getReduction() == proto::Reduction::SUM;
  for (auto s : c.getSlotNames()) cfg.slot_names.emplace_back(s);
  cfg.mode = c.getMode();
  cfg.staleness_bound = c.getStalenessBound();
  cfg.soft_sync_fraction = c.getSoftSyncFraction();
  cfg.step_deadline_ms = c.getStepDeadlineMs();
  cfg.ema_decay = c.getEmaDecay();
  return cfg;
}

Status Malformed(const kj::Exception& e) {
  return psd::Internal(std::string("malformed reply from psd: ") + e.getDescription().cStr());
}

Status Conn::Connect(int64_t limit_ms) {
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(limit_ms > 0 ? limit_ms : options_.connect_timeout_ms);
  for (;;) {
    Status s = ConnectOnce(deadline);
    if (s.ok() || s.code() != Code::kUnavailable || !answered_ || std::chrono::steady_clock::now() >= deadline) {
      return s;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

Status Conn::ConnectOnce(std::chrono::steady_clock::time_point deadline) {
  boost::system::error_code ec;
  answered_ = false;
  const std::string gave_up =
      " (gave up after ClientOptions::connect_timeout_ms = " + std::to_string(options_.connect_timeout_ms) + " ms)";
  for (;;) {
    // Names are resolved on every try: a restarted daemon (a Kubernetes pod, say) may have
    // come back at another address.
    tls_.reset();
    socket_ = psd::tcp::socket(io_);
    ahead_.Clear();
    Status c = internal::ConnectBefore(socket_, host_, port_, deadline);
    if (c.ok()) break;
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return psd::Unavailable(c.message() + gave_up);
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(std::chrono::milliseconds(50), deadline - now));
  }
  socket_.set_option(psd::tcp::no_delay(true), ec);
  if (options_.tls_enabled()) PSD_RETURN_IF_ERROR(StartTls(deadline));
  // The hello's answer is bounded by the same deadline (a daemon that accepts but never answers).
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  const bool connect_bound = left.count() < options_.request_timeout_ms;
  limit_ms_ = std::max<int64_t>(1, std::min<int64_t>(left.count(), options_.request_timeout_ms));
  OutFrame frame;
  auto req = NewRequest(frame);
  auto h = req.initHello();
  h.setProtocolVersion(proto::PROTOCOL_VERSION);
  h.setWorkerName(options_.worker_name);
  h.setIncarnation(options_.incarnation);
  h.setAuthToken(options_.auth_token);
  h.setObserver(options_.observer);
  proto::Response::Reader resp;
  Status s = SendNoReconnect(frame);
  if (s.ok()) s = Receive(frame, &resp);
  if (!s.ok()) {
    Drop();
    if (s.code() == Code::kDeadlineExceeded && !answered_ && connect_bound) {
      return psd::Unavailable("psd at " + Where() + " accepted the connection but did not answer its hello in time" +
                              gave_up);
    }
    return s;
  }
  if (resp.which() != proto::Response::HELLO) {
    Drop();
    return psd::Internal("unexpected reply to hello");
  }
  // A reply that is not a well-formed hello (Cap'n Proto throws reading it) fails the connect, as
  // any other malformed reply fails its call: nothing here throws to the caller.
  try {
    auto hr = resp.getHello();
    // Chunks are cut in whole parts of chunkElements elements (PlanFrames): psd's is 512, 0 means
    // it takes no chunks; a part so big that its bytes could wrap around is not a daemon's.
    if (hr.getChunkElements() > Conn::kMaxChunkElements) {
      Drop();
      return psd::Internal("psd at " + Where() + " announced chunks of " + std::to_string(hr.getChunkElements()) +
                           " elements (at most " + std::to_string(Conn::kMaxChunkElements) +
                           " make sense): a malformed hello; check that the daemon and this client are one release");
    }
    {
      std::lock_guard<std::mutex> lock(hello_mu);
      config = ReadConfig(hr.getConfig());
      worker_id = hr.getWorkerId();
      initial_step = hr.getGlobalStep();
    }
    is_chief = hr.getIsChief();
    chief_shard = hr.getChiefShard();
    cluster_epoch = hr.getClusterEpoch();
    shards_reported = static_cast<int>(hr.getShards());
    daemon_max_frame_bytes = hr.getMaxFrameBytes();
    daemon_reply_hold = hr.getMaxQueuedReplyBytes();
    chunk_elements = hr.getChunkElements();
    AttachShm(hr, deadline);
  } catch (const kj::Exception& e) {
    Drop();
    return Malformed(e);
  }
  ++connects;
  return Status::Ok();
}

void Conn::AttachShm(proto::HelloReply::Reader hr, std::chrono::steady_clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(shm_mu);
  shm.reset();
  values.reset();
  buffers = false;
  shm_used = 0;
  if (options_.shared_memory_bytes == 0) {
    shm_status = "off (ClientOptions::shared_memory_bytes is 0)";
    return;
  }
  if (!hr.hasShmSocket() || hr.getShmNonce().size() != psd::wire::kShmNonceBytes) {
    shm_status = "not offered (another host or network namespace, or psd --no-shared-memory)";
    return;
  }
  std::string name = hr.getShmSocket();
  auto sock = psd::wire::ConnectAbstract(name);
  if (!sock.ok()) {
    shm_status = "psd's socket @" + name + " is not reachable from here (" + sock.status().message() + ")";
    return;
  }
  // No bigger than psd maps (its --shm-max-bytes).
  const uint64_t max = hr.getShmMaxBytes() > 0 ? hr.getShmMaxBytes() : UINT64_MAX;
  const uint64_t bytes = std::min<uint64_t>(options_.shared_memory_bytes, max);
  auto seg = psd::wire::SharedSegment::Create(bytes, "psclient-" + std::to_string(index_));
  // The client's shared buffers go with it (segment 1) when psd maps that much.
  const bool with_buffers = arena_ != nullptr && arena_->size() <= max;
  // The frames too, through a lane psd makes (plain TCP only: with TLS they stay on its stream).
  const bool ask_lane = options_.shm_lane && !tls_;
  std::string answer;
  std::vector<int> passed;  // the descriptors sent with psd's "OK": its values segment, the lane's
  if (seg.ok()) {
    auto nonce = hr.getShmNonce();
    const std::string msg = psd::wire::ShmAttachMessage(
        hr.getConnectionId(), std::string_view(reinterpret_cast<const char*>(nonce.begin()), nonce.size()), ask_lane);
    std::vector<int> fds{(*seg)->fd()};
    if (with_buffers) fds.push_back(arena_->fd());
    Status sent = psd::wire::SendWithFds(*sock, msg.data(), msg.size(), fds);
    answer = sent.ok()
                 ? internal::ReadAnswer(
                       *sock, std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(5)), &passed)
                 : sent.message();
  } else {
    answer = seg.status().message();
  }
  ::close(*sock);
  // Asking for the lane, the answer says which descriptors came, in order; otherwise "OK" and the
  // values segment's, if any.
  bool has_values = !passed.empty(), has_lane = false;
  if (ask_lane && answer.rfind("OK", 0) == 0) {
    std::string rest = answer.substr(2);
    has_values = rest.rfind(psd::wire::kShmAnswerValues, 0) == 0;
    if (has_values) rest = rest.substr(std::strlen(psd::wire::kShmAnswerValues));
    has_lane = rest == psd::wire::kShmAnswerLane;
    if (rest.empty() || has_lane) answer = "OK";
    if (passed.size() != (has_values ? 1u : 0u) + (has_lane ? psd::wire::ShmLane::kFds : 0u))
      answer = "a malformed answer";
  }
  auto take = [&passed](size_t count) {
    std::vector<int> fds(passed.begin(), passed.begin() + static_cast<std::ptrdiff_t>(std::min(count, passed.size())));
    passed.erase(passed.begin(), passed.begin() + static_cast<std::ptrdiff_t>(fds.size()));
    return fds;
  };
  std::vector<int> values_fd = has_values ? take(1) : std::vector<int>{};
  std::vector<int> lane_fds = has_lane ? take(psd::wire::ShmLane::kFds) : std::vector<int>{};
  for (int fd : passed) ::close(fd);
  if (answer == "OK" && !values_fd.empty()) {
    // Read-only here (the descriptor is too); any doubt and the values come into the segment.
    auto mapped = psd::wire::SharedSegment::AdoptReadOnly(values_fd[0], UINT64_MAX);
    if (mapped.ok()) values = std::move(*mapped);
  } else {
    for (int fd : values_fd) ::close(fd);
  }
  lane_status.clear();
  if (answer == "OK" && has_lane) {
    auto lane = psd::wire::ShmLane::Adopt(lane_fds);  // takes them
    if (!lane.ok()) {
      lane_status = "frames over TCP: psd's lane could not be mapped (" + lane.status().message() + ")";
    } else if (!StartLane(std::move(*lane), deadline)) {
      return;  // the socket failed: the next call finds it broken, drops it and reconnects
    }
  } else {
    for (int fd : lane_fds) ::close(fd);
    if (answer == "OK" && ask_lane) lane_status = "frames over TCP: psd made no lane (see its log)";
  }
  if (answer == "OK") {
    shm = std::move(*seg);
    buffers = with_buffers;
    shm_socket_ = name;
    shm_status.clear();
    buffers_status = arena_ == nullptr || with_buffers
                         ? ""
                         : "shared buffers not attached: ClientOptions::shared_buffer_bytes " +
                               HumanBytes(arena_->size()) + " is over psd's --shm-max-bytes " + HumanBytes(max);
  } else {
    shm_status = "psd refused the segment: " + answer;
  }
}

bool Conn::StartLane(std::shared_ptr<psd::wire::ShmLane> lane, std::chrono::steady_clock::time_point deadline) {
  OutFrame frame;
  auto req = frame.builder.initRoot<proto::Request>();
  req.setId(0);  // never answered
  req.setUseLane();
  if (!psd::wire::WriteFrame(socket_, frame, deadline).ok()) {
    lane_status = "the connection broke as its frames moved to shared memory";
    return false;
  }
  lane_ = std::move(lane);
  return true;
}

Status Conn::LaneWait(psd::wire::ShmLane::Wait what, psd::wire::Deadline deadline) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return psd::DeadlineExceeded("no answer from psd before the deadline");
    pollfd p[2] = {{lane_->WaitFd(what), POLLIN, 0}, {socket_.native_handle(), POLLIN, 0}};
    int r = ::poll(p, 2, static_cast<int>(std::min<int64_t>(left.count() + 1, kStallCheckMs)));
    if (r < 0 && errno != EINTR) return psd::Unavailable(std::string("poll: ") + std::strerror(errno));
    // What psd wrote before it closed (a reply, then the close at shutdown) is read first.
    if (r > 0 && p[0].revents != 0) return Status::Ok();
    if (r > 0 && p[1].revents != 0) {
      if (what == psd::wire::ShmLane::Wait::kData && lane_->Readable() > 0) return Status::Ok();
      return psd::Unavailable("psd at " + Where() + " closed the connection (its shared-memory lane went with it)");
    }
    if (r == 0 && stall_check) PSD_RETURN_IF_ERROR(stall_check());
  }
}

Status Conn::LaneWrite(OutFrame& frame, psd::wire::Deadline deadline) {
  std::vector<psd::asio::const_buffer> parts = frame.Buffers();
  const size_t total = psd::asio::buffer_size(parts);
  size_t done = 0;
  while (done < total) {
    done += lane_->Write(parts.data(), parts.data() + parts.size(), done);
    if (done == total) break;
    if (lane_->broken()) return psd::Unavailable("the shared-memory lane to psd at " + Where() + " broke");
    if (!lane_->PrepareWait(psd::wire::ShmLane::Wait::kRoom)) continue;
    Status w = LaneWait(psd::wire::ShmLane::Wait::kRoom, deadline);
    lane_->FinishWait(psd::wire::ShmLane::Wait::kRoom);
    PSD_RETURN_IF_ERROR(w);
  }
  return Status::Ok();
}

Status Conn::LaneRead(void* dst, size_t n) {
  auto* p = static_cast<uint8_t*>(dst);
  std::chrono::steady_clock::time_point spin_until{};
  while (n > 0) {
    const size_t k = lane_->Read(p, n);
    p += k;
    n -= k;
    if (n == 0) break;
    if (k > 0) {
      spin_until = {};
      continue;
    }
    if (lane_->broken()) return psd::Unavailable("the shared-memory lane from psd at " + Where() + " broke");
    if (options_.busy_poll_us > 0) {  // ClientOptions::busy_poll_us: spin before sleeping
      auto now = std::chrono::steady_clock::now();
      if (spin_until == std::chrono::steady_clock::time_point{})
        spin_until = now + std::chrono::microseconds(options_.busy_poll_us);
      if (now < spin_until && now < deadline_) continue;
    }
    if (!lane_->PrepareWait(psd::wire::ShmLane::Wait::kData)) continue;
    Status w = LaneWait(psd::wire::ShmLane::Wait::kData, deadline_);
    lane_->FinishWait(psd::wire::ShmLane::Wait::kData);
    PSD_RETURN_IF_ERROR(w);
  }
  return Status::Ok();
}

Status Conn::WriteWhole(OutFrame& frame, psd::wire::Deadline deadline) {
  if (lane_) return LaneWrite(frame, deadline);
  return tls_ ? psd::wire::WriteFrame(*tls_, frame, deadline) : psd::wire::WriteFrame(socket_, frame, deadline);
}

Status Conn::Send(OutFrame& frame, int64_t wait_ms) {
  // A cluster's shard that was lost is tried briefly: the other shards' answers say what the
  // cluster waits for, and the caller retries (a single daemon gets the whole connect_timeout_ms
  // to come back).
  if (!IsOpen()) PSD_RETURN_IF_ERROR(Connect(quick_reconnect && connects > 0 ? kQuickReconnectMs : 0));
  PSD_RETURN_IF_ERROR(CheckFrameSize(frame));
  ++requests;
  limit_ms_ = std::max<int64_t>(options_.request_timeout_ms, wait_ms > 0 ? wait_ms + 10000 : 0);
  return SendNoReconnect(frame);
}

Status Conn::Receive(OutFrame& frame, proto::Response::Reader* resp, const psd::wire::Landing* landing) {
  uint64_t id = frame.builder.getRoot<proto::Request>().getId();
  answered_ = false;
  // Dropped since this request went out (a later frame of the batch failed, or an earlier reply):
  // its reply can never come, so the call fails now rather than at its deadline.
  if (!IsOpen()) {
    return psd::Unavailable("the connection to psd at " + Where() +
                            " was reset before this reply came; the next call reconnects");
  }
  static const std::string limit = "the client's ClientOptions::max_frame_bytes";  // built once, not per reply
  // The last reply's reader is done with: a buffer that one big reply grew is given back once the
  // replies since have been much smaller.
  in_.MaybeRelease(kKeptReplyBytes);
  // Plain TCP: the wait for the reply is a poll() (a cluster's shard is asked about while its
  // reply is late: stall_check), then the reads find it there. Reading first would find nothing
  // most of the time (a reply takes a round trip) and cost a system call a reply for it. Over TLS
  // the stream's own buffers may hold the reply already (a TLS read takes whole records, several
  // replies of a batch at once), so the read itself waits and asks, not a poll of the socket.
  if (!tls_ && !lane_) {
    Status w = WaitReadable();
    if (!w.ok()) {
      Drop();
      return w;
    }
  }
  Status s = lane_  ? psd::wire::ReadFrameWith([this](void* p, size_t n) { return LaneRead(p, n); }, in_,
                                              options_.max_frame_bytes, limit, landing)
             : tls_ ? psd::wire::ReadFrame(*tls_, in_, options_.max_frame_bytes, deadline_, limit, landing, stall_check,
                                           kStallCheckMs)
                    : psd::wire::ReadFrame(socket_, in_, options_.max_frame_bytes, deadline_, limit, landing,
                                           options_.busy_poll_us, &ahead_);
  if (!s.ok()) {
    // The stream is out of step (or gone): the next call reconnects.
    Drop();
    if (s.code() == psd::Code::kDeadlineExceeded) {
      return psd::DeadlineExceeded("no reply from psd at " + Where() + " within " + std::to_string(limit_ms_) +
                                   " ms; the connection was reset");
    }
    return s;
  }
  try {
    reader_ = in_.Reader();
    *resp = reader_->getRoot<proto::Response>();
    if (resp->getId() != id) {
      Drop();
      return psd::Internal("reply id " + std::to_string(resp->getId()) + " does not match request " +
                           std::to_string(id));
    }
    answered_ = true;
    last_reply_id_ = id;
    if (resp->getCode() != proto::Code::OK) return Status(psd::wire::FromWire(resp->getCode()), resp->getMessage());
  } catch (const kj::Exception& e) {
    Drop();
    return Malformed(e);
  }
  return Status::Ok();
}

Status Conn::WaitReadable() {
  if (ahead_.held() > 0) return Status::Ok();  // the reply (or its start) was read with the last one
  const int fd = socket_.native_handle();
  // ClientOptions::busy_poll_us: ReadFrame spins before it sleeps, so a reply that is about to
  // come is not waited for in poll() here either: the blocking wait starts after that long.
  if (options_.busy_poll_us > 0) {
    auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(options_.busy_poll_us);
    do {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 0) != 0) return Status::Ok();
    } while (std::chrono::steady_clock::now() < spin_until);
  }
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - std::chrono::steady_clock::now());
    if (left.count() <= 0) return Status::Ok();  // ReadFrame says the deadline passed
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), kStallCheckMs)));
    if (r != 0) return Status::Ok();  // readable, closed, or an error: ReadFrame tells which
    if (!stall_check) continue;
    Status verdict = stall_check();
    if (!verdict.ok()) return verdict;
  }
}

void Conn::Drop() {
  boost::system::error_code ec;
  (tls_ ? tls_->next_layer() : socket_).close(ec);
  ahead_.Clear();  // bytes of the old connection
  // A request cut off may still be read by the daemon from the old segment: the next connection
  // gets a new one, and the old pages live until the daemon lets them go. The shared buffers are
  // the caller's and stay: the daemon is told to touch them no more before this returns.
  bool revoke = false;
  std::string socket_name;
  {
    std::lock_guard<std::mutex> lock(shm_mu);
    if (shm) shm_status = "the connection was reset";
    shm.reset();
    lane_.reset();  // and its lane (psd unmaps its side with the connection)
    revoke = buffers;
    buffers = false;
    socket_name = shm_socket_;
  }
  if (revoke) RevokeBuffers(socket_name);
}

void Conn::RevokeBuffers(const std::string& socket_name) {
  // A daemon that is gone has no socket (and no mapping left to fear).
  auto sock = psd::wire::ConnectAbstract(socket_name);
  if (!sock.ok()) return;
  Status sent = psd::wire::SendWithFds(*sock, psd::wire::kShmRevokeMessage, psd::wire::kShmRevokeBytes, {arena_->fd()});
  // The daemon answers once no request of the old connection holds the buffers (one add or copy).
  if (sent.ok()) internal::ReadAnswer(*sock, std::chrono::steady_clock::now() + std::chrono::seconds(5));
  ::close(*sock);
}

Status Conn::CheckFrameSize(OutFrame& frame) {
  if (daemon_max_frame_bytes == 0) return Status::Ok();
  uint64_t bytes = frame.BodyBytes();
  if (bytes <= daemon_max_frame_bytes) return Status::Ok();
  std::string kind = "request";
  KJ_IF_MAYBE (field, capnp::toDynamic(frame.builder.getRoot<proto::Request>().asReader()).which()) {
    kind = field->getProto().getName().cStr();
    kind = kind == "createVariable" ? "create" : kind + " request";
  }
  return psd::ResourceExhausted("the " + kind + " is " + HumanBytes(bytes) + ", over psd's --max-frame-bytes " +
                                HumanBytes(daemon_max_frame_bytes) + " (" + Where() +
                                "): raise it on every shard, or send fewer or smaller variables per call");
}

uint64_t Conn::PushFrameLimit() const {
  if (options_.push_frame_bytes == 0) return 0;
  uint64_t limit = options_.push_frame_bytes + kFrameSlack;
  if (daemon_max_frame_bytes > 0)
    limit = std::min(limit, daemon_max_frame_bytes - std::min<uint64_t>(daemon_max_frame_bytes, 4096));
  return limit;
}

uint64_t Conn::CreateChunkBytes() const {
  if (options_.push_frame_bytes == 0 || chunk_elements == 0) return 0;
  const uint64_t limit = PushFrameLimit();  // a frame: the tensor and kFrameSlack for the rest
  const uint64_t room = limit > kFrameSlack ? limit - kFrameSlack : limit / 2;
  return std::max<uint64_t>(8, std::min<uint64_t>(options_.push_frame_bytes, room));
}

uint64_t Conn::PullFrameLimit() const {
  if (chunk_elements == 0 || options_.pull_frame_bytes == 0) return 0;
  return std::min(options_.pull_frame_bytes + kFrameSlack,
                  options_.max_frame_bytes - std::min<uint64_t>(options_.max_frame_bytes, 4096));
}

int64_t Conn::ShmReserve(uint64_t bytes) {
  if (!shm) return -1;
  uint64_t at = psd::wire::ShmAlign(shm_used);
  if (at > shm->size() || bytes > shm->size() - at) return -1;
  shm_used = at + bytes;
  return static_cast<int64_t>(at);
}

void Conn::PutInShm(proto::Tensor::Builder t, DType dtype, const Shape& shape, const void* data, size_t bytes) {
  const int64_t at = ShmReserve(bytes);
  if (bytes > 0) std::memcpy(shm->data() + at, data, bytes);
  RefInShm(t, dtype, shape, 0, static_cast<uint64_t>(at));
}

void Conn::RefInShm(proto::Tensor::Builder t, DType dtype, const Shape& shape, unsigned segment, uint64_t offset) {
  psd::wire::NameInShm(t, dtype, shape, segment, offset);
}

void Conn::ValuesRead() {
  if (!IsOpen()) return;  // dropped: psd let go of them with the connection
  OutFrame frame;
  auto req = frame.builder.initRoot<proto::Request>();
  req.setId(0);  // never answered
  req.setValuesRead(last_reply_id_);
  req.setValuesAck();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.request_timeout_ms);
  Status s = WriteWhole(frame, deadline);
  if (!s.ok()) Drop();  // the stream is broken: the next call reconnects
}

int64_t Conn::BufferOffset(const void* p, uint64_t bytes) const {
  return shm && buffers ? arena_->OffsetOf(p, bytes) : -1;
}

const uint8_t* Conn::ShmAt(unsigned segment, uint64_t offset, uint64_t bytes) const {
  if (!shm) return nullptr;
  if (segment == 0) return shm->At(offset, bytes);
  if (segment == psd::wire::kValuesSegment) return values ? values->At(offset, bytes) : nullptr;
  return segment == 1 && buffers ? arena_->At(offset, bytes) : nullptr;
}

Result<psd::wire::TensorRef> Conn::ReplyTensor(proto::Tensor::Reader t) const {
  // In shared memory, ShmAt bounds it by the segment.
  const bool in_shm = t.getInShm();
  auto ref = psd::wire::ReadTensor(t, in_shm ? std::numeric_limits<int64_t>::max() : options_.max_frame_bytes, in_shm);
  if (!ref.ok() || !in_shm) return ref;
  ref->bytes = static_cast<uint64_t>(psd::NumElements(ref->shape)) * psd::DTypeSize(ref->dtype);
  ref->data = ShmAt(t.getShmSegment(), t.getShmOffset(), ref->bytes);
  if (ref->data == nullptr) return psd::Internal("a value in shared memory outside this connection's segments");
  return ref;
}

Status Conn::SendNoReconnect(OutFrame& frame) {
  if (limit_ms_ == 0) limit_ms_ = options_.request_timeout_ms;
  deadline_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(limit_ms_);
  Status s = WriteWhole(frame, deadline_);
  if (!s.ok()) Drop();
  return s;
}

Status Conn::StartTls(std::chrono::steady_clock::time_point deadline) {
  if (!tls_context_) {
    auto ctx = psd::wire::MakeClientTlsContext({options_.tls_cert_file, options_.tls_key_file, options_.tls_ca_file});
    if (!ctx.ok()) return ctx.status();
    tls_context_ = std::move(*ctx);
  }
  tls_ = std::make_unique<psd::wire::ssl::stream<psd::tcp::socket>>(std::move(socket_), *tls_context_);
  socket_ = psd::tcp::socket(io_);
  PSD_RETURN_IF_ERROR(
      psd::wire::SetTlsServerName(*tls_, options_.tls_server_name.empty() ? host_ : options_.tls_server_name));
  Status s = psd::wire::TlsHandshake(*tls_, deadline);
  if (!s.ok()) {
    Drop();
    // Verification failures are not worth retrying: say what to fix.
    return s.code() == Code::kUnavailable ? psd::Unavailable("TLS with psd at " + Where() + ": " + s.message()) : s;
  }
  return Status::Ok();
}

Status FromShard(const Status& s, const Conn& c, bool cluster) {
  if (s.ok() || !cluster) return s;
  return Status(s.code(), "shard " + std::to_string(c.index()) + " (" + c.Where() + "): " + s.message());
}
}  // namespace psclient::internal
