#include "daemon/server.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "daemon/ops_service.h"
#include "ops/sd_notify.h"
#include "psd/listen_socket.h"
#include "service/values_segment.h"
#include "service/worker_session.h"

namespace psd::server {

namespace {

// Runs `io`'s handlers until it is stopped or out of work. busy_poll (--busy-poll): ready handlers
// run at once, never after a sleep in epoll_wait.
void Serve(asio::io_context& io, bool busy_poll) {
  for (;;) {
    try {
      if (!busy_poll) {
        io.run();
        return;
      }
      // poll() returns 0 with the context stopped once it runs out of work, like run().
      while (!io.stopped()) {
        if (io.poll() == 0) std::this_thread::yield();
      }
      return;
    } catch (const std::exception& e) {
      // A handler threw (e.g. out of memory building a reply): log and keep serving.
      spdlog::error("unexpected exception in an I/O handler: {}", e.what());
    }
  }
}

}  // namespace

Result<std::unique_ptr<Server>> Server::Create(ServerConfig config) {
  PSD_RETURN_IF_ERROR(config.Validate());
  std::shared_ptr<wire::ssl::context> tls, peer_tls;
  if (config.tls_enabled()) {
    wire::TlsFiles files{config.tls_cert_file, config.tls_key_file, config.tls_ca_file};
    auto server_ctx = wire::MakeServerTlsContext(files, config.tls_require_client_cert);
    if (!server_ctx.ok()) return server_ctx.status();
    tls = std::move(*server_ctx);
    // A shard dials the others as a TLS client with the same files (its certificate as the client's).
    auto client_ctx = wire::MakeClientTlsContext(files);
    if (!client_ctx.ok()) return client_ctx.status();
    peer_tls = std::move(*client_ctx);
  }
  auto server = std::unique_ptr<Server>(new Server(std::move(config), std::move(tls), std::move(peer_tls)));
  auto engine = server->MakeEngine(0);
  if (!engine.ok()) return engine.status();
  {
    MutexLock lock(&server->engine_mu_);
    server->engine_ = std::move(*engine);
  }
  return server;
}

Result<std::shared_ptr<TrainingEngine>> Server::MakeEngine(uint64_t epoch) {
  auto opt = MakeOptimizer(config_.optimizer);
  if (!opt.ok()) return opt.status();
  auto engine = std::make_shared<TrainingEngine>(config_, std::move(*opt));
  engine->set_epoch(epoch);
  engine->set_on_apply([this](double seconds) { metrics_.OnApply(seconds); });
  engine->set_on_commit([this](const StepInfo& info) {
    metrics_.OnStepCommitted(info.step, info.min_gradients, info.max_gradients, info.forced);
    if (info.forced) {
      spdlog::info("step {} committed by the step deadline with {}..{} gradient(s) per variable", info.step,
                   info.min_gradients, info.max_gradients);
    } else {
      spdlog::debug("step {} committed ({}..{} gradients averaged per variable)", info.step, info.min_gradients,
                    info.max_gradients);
    }
  });
  if (config_.mode == Mode::kSync && config_.step_deadline_ms > 0) {
    engine->set_on_step_started([this](int64_t step) { ArmStepDeadline(step); });
  }
  if (config_.mode == Mode::kSync) engine->set_on_take_deferred([this] { RetryTakesSoon(); });
  if (!config_.checkpoint_dir.empty()) {
    engine->set_on_snapshot([this](ShardSnapshot snap) { QueueSnapshot(std::move(snap)); });
  }
  if (config_.clustered()) {
    engine->set_step_commit(std::make_unique<ClusterStepCommit>(coordinator_.get(), epoch));
    engine->set_keep_committed(config_.replicas_per_shard > 1);
  }
  return engine;
}

std::shared_ptr<TrainingEngine> Server::engine() const {
  MutexLock lock(&engine_mu_);
  return engine_;
}

EngineStats Server::Stats() const {
  std::shared_ptr<TrainingEngine> engine;
  int64_t accepted = 0, stale = 0, max_staleness = 0;
  {
    MutexLock lock(&engine_mu_);
    engine = engine_;
    accepted = retired_accepted_;
    stale = retired_stale_;
    max_staleness = retired_max_staleness_;
  }
  EngineStats st = engine->Stats();  // outside the lock: it takes the token queue's
  st.accepted += accepted;
  st.stale += stale;
  st.max_staleness = std::max(st.max_staleness, max_staleness);
  return st;
}

void Server::QueueSnapshot(ShardSnapshot snap) { ckpt_writer_.Queue(std::move(snap)); }

bool Server::CheckpointWriterBusy() const { return ckpt_writer_.Busy(); }

Status Server::RestoreEngine(uint64_t epoch, int64_t step, std::vector<VarPlacement>* placements,
                             const ShardSnapshot* live) {
  auto fresh = MakeEngine(epoch);
  if (!fresh.ok()) return fresh.status();
  if (live != nullptr) {
    PSD_RETURN_IF_ERROR((*fresh)->Restore(*live));
  } else if (step >= 0) {
    ShardSnapshot snap;
    PSD_RETURN_IF_ERROR(LoadCheckpointAt(config_.checkpoint_dir, step, config_.shard_index, &snap));
    PSD_RETURN_IF_ERROR((*fresh)->Restore(snap));
    last_checkpoint_step_ = step;
  }
  *placements = (*fresh)->Placements(config_.shard_index);
  std::shared_ptr<TrainingEngine> old;
  {
    // One step for readers of Stats(): the old engine's counts move into the retired ones as it
    // goes (a push still landing in it is not counted; none is told it was).
    MutexLock lock(&engine_mu_);
    old = std::exchange(engine_, *fresh);
    const EngineStats gone = old->Counters();
    retired_accepted_ += gone.accepted;
    retired_stale_ += gone.stale;
    retired_max_staleness_ = std::max(retired_max_staleness_, gone.max_staleness);
  }
  old->tokens().Close(Aborted("the cluster restored " +
                              (live != nullptr ? "the live copies of step " + std::to_string(step)
                               : step < 0      ? std::string("an empty state")
                                               : "checkpoint step " + std::to_string(step)) +
                              " (epoch " + std::to_string(epoch) + "): pull the variables and go on from there"));
  return Status::Ok();
}

void Server::FinishJob() {
  if (!config_.exit_when_done) return;
  MutexLock lock(&stop_mu_);
  job_done_ = true;
  stop_requested_ = true;
  stop_cv_.NotifyAll();
}

Server::Server(ServerConfig config, std::shared_ptr<wire::ssl::context> tls,
               std::shared_ptr<wire::ssl::context> peer_tls)
    : config_(std::move(config)),
      tls_(std::move(tls)),
      peer_tls_(std::move(peer_tls)),
      conn_env_(MakeConnectionEnv()),
      workers_(config_.replicas_to_aggregate, config_.total_replicas),
      ssp_(config_.staleness_bound),
      acceptor_(io_),
      accept_backoff_(io_),
      summary_timer_(io_),
      deadline_strand_(asio::make_strand(io_)),
      step_deadline_(deadline_strand_),
      take_retry_(deadline_strand_),
      cluster_strand_(asio::make_strand(io_)),
      cluster_tick_(cluster_strand_),
      ready_timer_(io_),
      checkpoint_timer_(io_) {
  not_ready_ = "psd is starting";
  not_ready_since_ = start_time_;
  if (config_.clustered()) {
    cluster_host_ = std::make_unique<ServerShardHost>(*this);
    const auto& links = config_.peer_links.empty() ? config_.cluster : config_.peer_links;
    peer_network_ = std::make_unique<TcpPeerNetwork>(
        io_,
        TcpPeerNetwork::Options{links, config_.shard_index, config_.auth_token, config_.cluster_secret, peer_tls_});
    ClusterOptions options;
    options.me = config_.shard_index;
    options.addresses = config_.cluster;
    options.heartbeat_ms = config_.heartbeat_ms;
    options.election_timeout_ms = config_.election_timeout_ms;
    options.checkpoint_dir = config_.checkpoint_dir;
    options.checkpoint_every_steps = config_.checkpoint_every_steps;
    options.keep_checkpoints = config_.keep_checkpoints;
    options.slice_bytes = config_.slice_bytes;
    options.restore = config_.restore;
    options.allow_state_loss = config_.allow_state_loss;
    options.applies_on_arrival = config_.mode != Mode::kSync;
    options.replicate = config_.replicas_per_shard > 1;
    // A copy holds part of the model (--max-model-bytes counts values, slots and averages).
    options.max_copy_bytes = config_.max_model_bytes * 4;
    options.takeover_after = std::chrono::milliseconds(config_.stand_in ? 0 : config_.takeover_after_ms);
    options.stand_in = config_.stand_in;
    options.links = config_.peer_links;
    coordinator_ = std::make_unique<ClusterCoordinator>(
        std::move(options), *cluster_host_, *peer_network_, &std::chrono::steady_clock::now,
        [this] { asio::post(cluster_strand_, [this] { coordinator_->Tick(); }); },
        [this](std::function<void()> batch) { asio::post(cluster_lane_, std::move(batch)); });
    peer_network_->set_events(coordinator_.get());
  }
  ops_ = std::make_unique<ops::OpsService>(*this, io_);
}

ConnectionEnv Server::MakeConnectionEnv() {
  ConnectionEnv env;
  env.hello_timeout_ms = config_.hello_timeout_ms;
  env.idle_timeout_s = config_.idle_timeout_s;
  env.frame_timeout_ms = config_.frame_timeout_ms;
  env.max_frame_bytes = config_.max_frame_bytes;
  env.max_queued_reply_bytes = config_.max_queued_reply_bytes;
  env.budget = &frame_budget_;
  env.frame_buffers = &frame_pool_;
  env.tls = tls_;
  env.stranger_log = &connection_log_;
  env.on_bytes_in = [this](uint64_t n) { metrics_.OnBytesIn(n); };
  env.on_bytes_out = [this](uint64_t n) { metrics_.OnBytesOut(n); };
  env.on_frame_timeout = [this] { metrics_.OnFrameTimeout(); };
  env.on_reads_paused = [this] { metrics_.OnReadsPaused(); };
  return env;
}

void Server::ScheduleClusterTick() {
  cluster_tick_.expires_after(std::chrono::milliseconds(config_.heartbeat_ms));
  cluster_tick_.async_wait([this](boost::system::error_code ec) {
    if (ec) return;
    coordinator_->Tick();
    ScheduleClusterTick();
  });
}

uint16_t Server::metrics_port() const { return ops_->port(); }

double Server::uptime_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time_).count();
}

int Server::connection_count() const {
  MutexLock lock(&conns_mu_);
  return static_cast<int>(conns_.size());
}

std::vector<int> Server::ConnectionsPerIoThread() const {
  MutexLock lock(&conns_mu_);
  return conn_io_load_;
}

Status Server::Serving() const {
  if (coordinator_) return coordinator_->Serving();
  MutexLock lock(&ready_mu_);
  if (not_ready_.empty()) return Status::Ok();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - not_ready_since_).count();
  return Unavailable(fmt::format("{} (for {:.1f} s); retry", not_ready_, secs));
}

Status Server::PlacementMap(std::vector<VarPlacement>* all, std::vector<uint64_t>* shard_bytes) const {
  if (coordinator_) return coordinator_->Placements(all, shard_bytes);
  // A single daemon holds everything.
  *all = engine()->Placements(0);
  shard_bytes->assign(1, 0);
  for (const VarPlacement& p : *all) (*shard_bytes)[0] += p.bytes();
  return Status::Ok();
}

void Server::ArmStepDeadline(int64_t step) {
  asio::post(deadline_strand_, [this, step] {
    step_deadline_.expires_after(std::chrono::milliseconds(config_.step_deadline_ms));
    step_deadline_.async_wait([this, step](boost::system::error_code ec) {
      if (!ec) engine()->ForceStep(step);
    });
  });
}

void Server::RetryTakesSoon() {
  asio::post(deadline_strand_, [this] {
    if (take_retry_armed_ || stopped_.load()) return;
    take_retry_armed_ = true;
    take_retry_.expires_after(std::chrono::milliseconds(kTakeRetryMs));
    take_retry_.async_wait([this](boost::system::error_code ec) {
      take_retry_armed_ = false;
      if (!ec) engine()->RetryDeferredTakes();
    });
  });
}

// Runs on the checkpoint thread (or in Stop() after it ended): file I/O only, no engine lock held.
void Server::WriteSnapshot(const ShardSnapshot& snap) {
  auto t0 = std::chrono::steady_clock::now();
  auto info =
      WriteCheckpoint(config_.checkpoint_dir, snap, config_.shard_index, config_.shards(), config_.keep_checkpoints);
  if (!info.ok()) {
    metrics_.OnCheckpointFailed();
    spdlog::error("checkpoint at step {} failed: {}", snap.step, info.status().message());
    return;
  }
  metrics_.OnCheckpointWritten(snap.step, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                               info->part_bytes);
  if (coordinator_) {  // the chief seals it once every part is in
    coordinator_->OnPartWritten(snap.epoch, snap.step,
                                {config_.shard_index, info->part_file, info->part_bytes, info->part_checksum});
  }
  if (!coordinator_) last_checkpoint_step_ = snap.step;
  // The stop-window rule (README, "Checkpoints and recovery"): a stop may have to finish a write in
  // flight and then write the final checkpoint, so it needs two writes at the measured speed + 10 s.
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const double mb = static_cast<double>(info->part_bytes) / 1e6;
  const double window_s = std::ceil(2 * ms / 1000 + 10);
  spdlog::info(
      "checkpoint {}at step {} written to {} ({:.0f} MB in {:.0f} ms, {:.0f} MB/s; stop window needed >= {:.0f} s)",
      coordinator_ ? "part " : "", snap.step, info->path, mb, ms, mb / std::max(ms, 1.0) * 1000, window_s);
  if (window_s > 30 && !stop_window_warned_.exchange(true)) {
    spdlog::warn(
        "a checkpoint of this state takes {:.1f} s here: give psd a stop window of at least {:.0f} s (systemd "
        "TimeoutStopSec, default 90 s; Kubernetes terminationGracePeriodSeconds, default 30 s), or a stop may kill "
        "it mid-checkpoint (the previous checkpoint then stays the newest)",
        ms / 1000, window_s);
  }
}

Status Server::RequestCheckpoint() {
  if (config_.checkpoint_dir.empty()) return FailedPrecondition("psd runs without --checkpoint-dir");
  if (coordinator_) {
    coordinator_->RequestCheckpoint(/*timed=*/false);
  } else {
    // Not while the start-up restore fills the engine: its snapshot would be an empty or half
    // restored state, written as step 0.
    PSD_RETURN_IF_ERROR(Serving());
    if (ckpt_writer_.Defer()) return Status::Ok();  // one snapshot after the write under way
    engine()->RequestSnapshot();
  }
  return Status::Ok();
}

void Server::ScheduleCheckpointTimer() {
  if (config_.checkpoint_dir.empty() || config_.checkpoint_every_s <= 0) return;
  checkpoint_timer_.expires_after(std::chrono::milliseconds(static_cast<int64_t>(config_.checkpoint_every_s * 1000)));
  checkpoint_timer_.async_wait([this](boost::system::error_code ec) {
    if (ec) return;
    if (coordinator_) {
      coordinator_->RequestCheckpoint(/*timed=*/true);
    } else if (Serving().ok()) {  // not during the start-up restore (RequestCheckpoint)
      engine()->RequestSnapshot();
    }
    ScheduleCheckpointTimer();
  });
}

Result<uint32_t> Server::OnHello(uint64_t conn, const std::string& name, uint64_t incarnation) {
  uint64_t replaced = 0;
  bool took_slot = false;
  auto index = workers_.Hello(conn, name, incarnation, &replaced, &took_slot);
  if (!index.ok()) {
    spdlog::warn("{}", index.status().message());
    return index.status();
  }
  if (took_slot) metrics_.ResetWorker(*index);  // the lost worker's figures are not this one's
  if (replaced != 0) {
    // The worker's old connection (it reconnected, or restarted): closed, so that two connections
    // never count as one worker. Its parked waits give their tokens back as it closes.
    std::shared_ptr<Connection> old;
    {
      MutexLock lock(&conns_mu_);
      if (auto it = conns_.find(replaced); it != conns_.end()) old = it->second.lock();
    }
    if (old) asio::post(old->strand(), [old] { old->CloseNow(); });  // its parked waits end now
  }
  // A finished worker saying hello again (to read values) holds nobody back at the gate.
  if (config_.mode == Mode::kSsp && !workers_.IsFinished(*index)) ssp_.Join(*index);
  UpdateRequired();
  return *index;
}

void Server::UpdateRequired() {
  int required = std::min(config_.InitialRequiredReplicas(), workers_.RequiredReplicas());
  if (coordinator_) return coordinator_->SetLocalRequired(required);  // the chief's count is the cluster's
  engine()->SetRequiredReplicas(required);
}

Server::~Server() { Stop(); }

Status Server::AdoptListenFd() {
  const int fd = config_.listen_fd;
  auto bound = psd::InspectListeningSocket(fd, config_.listen_fd_source);
  Status ok = bound.ok() ? psd::CheckListenAddress(*bound, config_.host, config_.port, config_.listen_fd_source)
                         : bound.status();
  boost::system::error_code ec;
  if (ok.ok()) {
    bool v6 = bound->ip.find(':') != std::string::npos;
    acceptor_.assign(v6 ? tcp::v6() : tcp::v4(), fd, ec);
    if (ec) ok = Unavailable(config_.listen_fd_source + ": " + ec.message());
  }
  if (!ok.ok() && !acceptor_.is_open()) ::close(fd);  // owned from Start() on, even when refused
  return ok;
}

Status Server::Start() {
  // A socket bound by the launcher (psrun, a test, systemd) is served as it is, once checked; first,
  // so that it is owned (and closed) whatever fails below.
  if (config_.listen_fd >= 0) PSD_RETURN_IF_ERROR(AdoptListenFd());
  // Start-up checks that touch the system (Validate() checked the values).
  PSD_RETURN_IF_ERROR(EnsureFdLimit(config_.max_connections));
  if (!config_.checkpoint_dir.empty()) PSD_RETURN_IF_ERROR(PrepareCheckpointDir(config_.checkpoint_dir));
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(config_.host, ec);
  if (ec) return InvalidArgument("--host '" + config_.host + "' is not an IP address: " + ec.message());
  if (config_.listen_fd < 0) {
    tcp::endpoint ep(addr, config_.port);
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return Unavailable("cannot listen on " + config_.host + ":" + std::to_string(config_.port) + ": " + ec.message());
    }
  }
  port_ = acceptor_.local_endpoint().port();
  if (config_.shared_memory) {
    shm_ = std::make_unique<ShmListener>(io_, config_.shm_max_bytes, config_.hello_timeout_ms);
    // Big buffers in the values segment, which same-host workers read pulled values from.
    if (config_.values_segment) {
      if (auto values = ValuesSegment::Open(config_.max_model_bytes); values.ok()) {
        shm_->SetValuesDescriptor((*values)->read_only_fd());
      } else {
        spdlog::warn("the values segment: {}; same-host workers get values written into their segments",
                     values.status().message());
      }
    }
    Status shm = shm_->Start();
    if (!shm.ok()) {
      // Not fatal: workers on this host then move tensors over TCP.
      spdlog::warn("{}; same-host workers will use TCP", shm.message());
      shm_.reset();
    }
  }
  PSD_RETURN_IF_ERROR(ops_->Start());
  if (!config_.checkpoint_dir.empty()) ckpt_writer_.Start();
  work_ = std::make_unique<asio::executor_work_guard<asio::io_context::executor_type>>(io_.get_executor());
  for (int i = 0; i < config_.io_threads; ++i) {
    // Hint 1: each is run by one thread (others only post to it).
    conn_ios_.push_back(std::make_unique<asio::io_context>(1));
    conn_work_.push_back(asio::make_work_guard(*conn_ios_.back()));
  }
  {
    MutexLock lock(&conns_mu_);
    conn_io_load_.assign(conn_ios_.size(), 0);
  }
  if (coordinator_ && config_.stand_in) {
    std::string address = SocketAddress{config_.advertise_host, port_}.ToString();
    coordinator_->SetAddress(address);
    spdlog::info("psd stand-in for shard {} of {} ({}), serving at {}", config_.shard_index, config_.shards(),
                 config_.cluster[static_cast<size_t>(config_.shard_index)], address);
  } else if (coordinator_) {
    spdlog::info("psd shard {} of {} ({})", config_.shard_index, config_.shards(),
                 config_.cluster[static_cast<size_t>(config_.shard_index)]);
  }
  if (coordinator_) {
    cluster_lane_work_ =
        std::make_unique<asio::executor_work_guard<asio::io_context::executor_type>>(cluster_lane_.get_executor());
    cluster_lane_thread_ = std::thread([this] { Serve(cluster_lane_, false); });
    coordinator_->Start();  // before anything is accepted
    peer_network_->Start();
    asio::dispatch(cluster_strand_, [this] { ScheduleClusterTick(); });
  }
  // Connections are served from now on, so probes, psd_admin and the status page answer while a
  // restore runs; workers are told to retry until psd is ready (Serving()).
  Accept();
  accepting_ = true;
  last_summary_time_ = std::chrono::steady_clock::now();
  ScheduleSummary();
  ScheduleCheckpointTimer();
  // The control plane's thread, then one per connections' io_context (--busy-poll polls those).
  threads_.emplace_back([this] { Serve(io_, false); });
  for (auto& io : conn_ios_) {
    threads_.emplace_back([this, ctx = io.get()] { Serve(*ctx, config_.busy_poll); });
  }
  spdlog::info(
      "psd listening on {}:{} (mode={} R={} total={} tokens/step={} init tokens={} optimizer={} lr={} {}; {} I/O "
      "threads, {} apply threads)",
      config_.host, port_, ModeName(config_.mode), config_.replicas_to_aggregate, config_.total_replicas,
      config_.tokens_per_step, config_.resolved_init_tokens, config_.optimizer.name, config_.optimizer.learning_rate,
      ReductionName(config_.reduction), config_.io_threads, config_.apply_threads);
  for (const std::string& caution : config_.Cautions()) spdlog::warn("{}", caution);
  if (coordinator_) {
    // The chief restores and pushes the init tokens once the cluster has formed.
    WatchReadiness();
    return Status::Ok();
  }
  if (!config_.checkpoint_dir.empty() && config_.restore) PSD_RETURN_IF_ERROR(RestoreAtStart());
  // Init tokens carry the current (possibly restored) global step, as TF's chief does on restart.
  engine()->PushInitTokens(config_.resolved_init_tokens);
  {
    MutexLock lock(&ready_mu_);
    not_ready_.clear();
  }
  return BecomeReady();
}

Status Server::RestoreAtStart() {
  {
    MutexLock lock(&ready_mu_);
    not_ready_ = "restoring the newest checkpoint of " + config_.checkpoint_dir;
    not_ready_since_ = std::chrono::steady_clock::now();
  }
  spdlog::info("restoring the newest good checkpoint of {}; workers are asked to retry until it is done",
               config_.checkpoint_dir);
  auto t0 = std::chrono::steady_clock::now();
  // A long restore says every 5 s that it is still going.
  auto done = std::make_shared<std::atomic<bool>>(false);
  auto progress = std::make_shared<asio::steady_timer>(io_);
  auto tick = std::make_shared<std::function<void()>>();
  *tick = [done, progress, t0, weak = std::weak_ptr<std::function<void()>>(tick)] {
    progress->expires_after(std::chrono::seconds(5));
    progress->async_wait([done, t0, weak, progress](boost::system::error_code ec) {
      if (ec || done->load()) return;
      spdlog::info("still restoring ({:.0f} s so far)",
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (auto next = weak.lock()) (*next)();
    });
  };
  asio::post(io_, *tick);
  struct Stop {
    std::shared_ptr<std::atomic<bool>> done;
    std::shared_ptr<asio::steady_timer> timer;
    ~Stop() {
      done->store(true);
      asio::post(timer->get_executor(), [t = timer] { t->cancel(); });
    }
  } stop_progress{done, progress};
  ShardSnapshot snap;
  auto found = LoadLatestCheckpoint(config_.checkpoint_dir, 0, &snap);
  if (!found.ok()) {
    if (found.status().code() == Code::kNotFound) {
      spdlog::info("no checkpoint in {}: starting at step 0", config_.checkpoint_dir);
      return Status::Ok();
    }
    return found.status();
  }
  PSD_RETURN_IF_ERROR(engine()->Restore(snap));
  last_checkpoint_step_ = snap.step;
  uint64_t bytes = 0;
  for (const auto& v : snap.variables) bytes += v.value ? v.value->bytes() : 0;
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  metrics_.OnRestored(snap.step, secs, bytes);
  spdlog::info("restored {} variable(s) at global step {} from {} ({:.1f} MB of values in {:.2f} s)",
               snap.variables.size(), snap.step, found->path, static_cast<double>(bytes) / 1e6, secs);
  return Status::Ok();
}

Status Server::BecomeReady() {
  if (became_ready_.exchange(true)) return Status::Ok();
  if (!config_.port_file.empty()) {
    std::string tmp = config_.port_file + ".tmp";
    {
      std::ofstream f(tmp);
      f << port_ << "\n";
      if (!f) return Unavailable("cannot write --port-file " + config_.port_file);
    }
    if (std::rename(tmp.c_str(), config_.port_file.c_str()) != 0) {
      return Unavailable("cannot write --port-file " + config_.port_file);
    }
  }
  Status notified = ops::SdNotify(config_.notify_socket, "READY=1\nSTATUS=serving workers");
  if (!notified.ok()) spdlog::warn("{}", notified.message());
  spdlog::info("psd is ready: serving workers on {}:{}", config_.host, port_);
  return Status::Ok();
}

void Server::WatchReadiness() {
  ready_timer_.expires_after(std::chrono::milliseconds(20));
  ready_timer_.async_wait([this](boost::system::error_code ec) {
    if (ec || stopped_.load()) return;
    if (!Serving().ok()) return WatchReadiness();
    Status s = BecomeReady();
    if (!s.ok()) spdlog::error("{}", s.message());
  });
}

void Server::Accept() {
  // Accepted on the control plane, then moved to the connections' io_context that has the fewest
  // live connections when it arrives (see server.h "Threading model").
  acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
    if (ec) {
      if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
      if (ec == asio::error::no_descriptors || ec == boost::system::errc::too_many_files_open_in_system ||
          ec == asio::error::no_buffer_space || ec == asio::error::no_memory) {
        // Out of descriptors (or kernel memory): retrying at once would spin. Back off 100 ms
        // doubling to 1 s, and say so once per episode.
        if (accept_backoff_ms_ == 0) {
          spdlog::error("accept failed: {}; backing off; raise the fd limit or lower --max-connections", ec.message());
        }
        accept_backoff_ms_ = std::clamp(accept_backoff_ms_ * 2, 100, 1000);
        accept_backoff_.expires_after(std::chrono::milliseconds(accept_backoff_ms_));
        return accept_backoff_.async_wait([this](boost::system::error_code tec) {
          if (!tec && acceptor_.is_open()) Accept();
        });
      }
      spdlog::warn("accept failed: {}", ec.message());
      return Accept();
    }
    if (accept_backoff_ms_ > 0) {
      spdlog::info("accepting connections again after running out of descriptors");
      accept_backoff_ms_ = 0;
    }
    uint64_t id = next_conn_id_.fetch_add(1);
    size_t live = 0;
    {
      MutexLock lock(&conns_mu_);
      live = conns_.size();
    }
    bool refuse = static_cast<int>(live) >= config_.max_connections;
    bool evicted = false;
    // At the limit, the connection that has waited longest for its hello makes room (it closes
    // once its strand gets to it: up to kEvictionSlack over the limit meanwhile), so clients that
    // connect and say nothing cannot keep workers, tools and shards out.
    if (refuse && static_cast<int>(live) < config_.max_connections + kEvictionSlack && awaiting_hello_.EvictOldest()) {
      refuse = false;
      evicted = true;
    }
    size_t io = 0;
    {
      MutexLock lock(&conns_mu_);
      if (!refuse) {
        io = static_cast<size_t>(std::min_element(conn_io_load_.begin(), conn_io_load_.end()) - conn_io_load_.begin());
        ++conn_io_load_[io];
        conn_io_of_[id] = io;
      }
    }
    std::shared_ptr<Connection> conn;
    if (!refuse) {
      boost::system::error_code move_ec;
      const auto protocol = socket.local_endpoint(move_ec).protocol();
      // The socket runs on its io_context's plain executor: every completion is bound to the
      // connection's strand (Connection::strand), and a strand as the socket's own executor would
      // not fit asio's polymorphic executor in place (two allocations per read and per write).
      tcp::socket moved(*conn_ios_[io]);
      tcp::socket::native_handle_type fd = -1;
      if (!move_ec) fd = socket.release(move_ec);
      if (!move_ec) {
        moved.assign(protocol, fd, move_ec);
        if (move_ec) ::close(fd);  // released but not adopted: closed here, not leaked
      }
      if (move_ec) {
        spdlog::warn("accepted connection lost before it was served: {}", move_ec.message());
        MutexLock lock(&conns_mu_);
        --conn_io_load_[io];
        conn_io_of_.erase(id);
        return Accept();
      }
      conn = std::make_shared<Connection>(std::move(moved), conn_env_, id);
      MutexLock lock(&conns_mu_);
      conns_[id] = conn;
    }
    if (refuse) {
      metrics_.OnConnectionRefused();
      if (const int64_t suppressed = refusal_log_.Allow(); suppressed >= 0) {
        spdlog::warn("refusing connection: --max-connections {} reached, every connection has said hello{}",
                     config_.max_connections, peer_auth::LogLimiter::SuppressedNote(suppressed));
      }
    } else {
      metrics_.OnConnectionAccepted();
      if (evicted) {
        metrics_.OnConnectionRefused();  // the one closed to make room
        if (const int64_t suppressed = refusal_log_.Allow(); suppressed >= 0) {
          spdlog::warn(
              "--max-connections {} reached: closed the connection that waited longest for its hello to make room{}",
              config_.max_connections, peer_auth::LogLimiter::SuppressedNote(suppressed));
        }
      }
      awaiting_hello_.Add(conn);
      conn->Start(std::make_shared<WorkerSession>(*this, conn));
    }
    Accept();
  });
}

void Server::ScheduleSummary() {
  if (config_.summary_interval_s <= 0) return;
  summary_timer_.expires_after(std::chrono::milliseconds(static_cast<int64_t>(config_.summary_interval_s * 1000)));
  summary_timer_.async_wait([this](boost::system::error_code ec) {
    if (ec) return;
    LogSummary();
    ScheduleSummary();
  });
}

void Server::LogSummary() {
  EngineStats st = Stats();
  WorkerCounts wc = workers_.Counts();
  auto now = std::chrono::steady_clock::now();
  double secs = std::chrono::duration<double>(now - last_summary_time_).count();
  double rate = secs > 0 ? static_cast<double>(st.global_step - last_summary_step_) / secs : 0;
  if (config_.mode == Mode::kSync) {
    spdlog::info(
        "step {} ({:.1f} steps/s) | pushes accepted {} stale {} | tokens queued {} | workers {} "
        "connected, {} finished | step needs {} gradient(s), last used {}",
        st.global_step, rate, st.accepted, st.stale, st.tokens_queued, wc.connected, wc.finished, st.required_replicas,
        st.last_step_gradients);
  } else {
    spdlog::info(
        "step {} ({:.1f} steps/s) | gradients applied {} | max staleness {} | workers {} connected, {} "
        "finished{}",
        st.global_step, rate, st.accepted, st.max_staleness, wc.connected, wc.finished,
        config_.mode == Mode::kSsp ? fmt::format(" | slowest clock {}", ssp_.MinClock()) : "");
  }
  if (coordinator_) {
    auto v = coordinator_->Describe();
    spdlog::info("cluster: shard {} of {}, chief {}, term {}, epoch {}: {}", config_.shard_index, config_.shards(),
                 v.chief, v.term, v.epoch, v.state);
  }
  last_summary_step_ = st.global_step;
  last_summary_time_ = now;
}

void Server::OnWorkerFinished(uint64_t conn) {
  int64_t index = workers_.IndexOf(conn);
  workers_.Finished(conn);
  if (index >= 0 && config_.mode == Mode::kSsp) ssp_.Leave(static_cast<uint32_t>(index));
  UpdateRequired();
  EndJobIfDone();
}

void Server::EndJobIfDone() {
  if (!workers_.AllFinished()) {
    // Workers that all gave up (none finished, none came back within --worker-grace-s) end the
    // job too with --exit-when-done; without it psd waits for a worker to come back.
    if (!config_.exit_when_done || !workers_.AllGone()) return;
    spdlog::error(
        "every worker is gone without finishing (none came back within --worker-grace-s {} s): the job "
        "ends (--exit-when-done)",
        config_.worker_grace_s);
  } else if (!config_.exit_when_done && workers_.AnyLost()) {
    // The workers still here finished, others are lost: one that comes back counts again (and
    // trains on), so the job is not declared over to it. What was trained is checkpointed, as the
    // job's end would have.
    spdlog::info("the workers still connected finished; psd waits for the lost ones to come back (or stop it)");
    if (!config_.checkpoint_dir.empty()) {
      if (coordinator_) {
        if (coordinator_->is_chief()) coordinator_->RequestCheckpoint(/*timed=*/false);
      } else {
        engine()->RequestSnapshot();
      }
    }
    return;
  }
  if (coordinator_) {
    // The chief's registry decides for the cluster; the others hear it from the chief.
    if (coordinator_->is_chief()) coordinator_->OnJobDone();
    return;
  }
  spdlog::info("all workers finished at global step {}", engine()->global_step());
  engine()->tokens().Close(OutOfRange("training is over: all workers finished"));
  ssp_.Close(OutOfRange("training is over: all workers finished"));
  if (config_.exit_when_done) {
    MutexLock lock(&stop_mu_);
    job_done_ = true;
    stop_requested_ = true;
    stop_cv_.NotifyAll();
  }
}

void Server::OnConnectionClosed(uint64_t conn) {
  int64_t index = workers_.IndexOf(conn);
  if (index >= 0 && config_.mode == Mode::kSsp) ssp_.Leave(static_cast<uint32_t>(index));
  auto gone = workers_.Disconnected(conn);
  if (gone && config_.worker_grace_s > 0 && !stopped_.load()) {
    // If it does not come back in time, steps stop waiting for its gradients.
    auto timer = std::make_shared<asio::steady_timer>(io_);
    timer->expires_after(std::chrono::milliseconds(static_cast<int64_t>(config_.worker_grace_s * 1000)));
    timer->async_wait([this, timer, index = gone->first, generation = gone->second](boost::system::error_code ec) {
      if (ec) return;
      auto name = workers_.MarkLostIfStillGone(index, generation);
      if (!name) return;
      UpdateRequired();
      spdlog::warn("worker '{}' did not come back within {} s: counted as gone; a step now needs {} gradient(s)", *name,
                   config_.worker_grace_s, engine()->required_replicas());
      EndJobIfDone();
    });
  }
  MutexLock lock(&conns_mu_);
  conns_.erase(conn);
  if (auto it = conn_io_of_.find(conn); it != conn_io_of_.end()) {
    --conn_io_load_[it->second];
    conn_io_of_.erase(it);
  }
}

bool Server::Wait() {
  MutexLock lock(&stop_mu_);
  while (!stop_requested_) stop_cv_.Wait(&stop_mu_);
  return job_done_;
}

void Server::RequestStop() {
  MutexLock lock(&stop_mu_);
  stop_requested_ = true;
  stop_cv_.NotifyAll();
}

void Server::Stop() {
  if (stopped_.exchange(true)) return;
  RequestStop();
  if (became_ready_.load()) (void)ops::SdNotify(config_.notify_socket, "STOPPING=1");
  ops_->Stop();
  asio::post(io_, [this] {
    boost::system::error_code ec;
    acceptor_.close(ec);
    if (shm_) shm_->Stop();
    accept_backoff_.cancel();
    summary_timer_.cancel();
    checkpoint_timer_.cancel();
    ready_timer_.cancel();
  });
  asio::post(deadline_strand_, [this] {
    step_deadline_.cancel();
    take_retry_.cancel();
  });
  if (coordinator_) {
    coordinator_->Stop();
    // The actions decided before: run (answers owed, a copy being kept), nothing new after.
    cluster_lane_work_.reset();
    if (cluster_lane_thread_.joinable()) cluster_lane_thread_.join();
    asio::post(cluster_strand_, [this] { cluster_tick_.cancel(); });
    peer_network_->Stop();  // after up to ~1 s for queued messages
    cluster_host_->Join();  // a restore's completion calls the coordinator
  }
  engine()->tokens().Close(Cancelled("psd is shutting down"));
  ssp_.Close(Cancelled("psd is shutting down"));
  std::vector<std::shared_ptr<Connection>> live;
  {
    MutexLock lock(&conns_mu_);
    for (auto& [id, weak] : conns_) {
      if (auto c = weak.lock()) live.push_back(c);
    }
  }
  for (auto& c : live) c->CloseGracefully();
  live.clear();
  work_.reset();
  // Give replies in flight up to 2 s to drain, then stop the loop regardless.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (std::chrono::steady_clock::now() < deadline) {
    {
      MutexLock lock(&conns_mu_);
      if (conns_.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  io_.stop();
  for (auto& io : conn_ios_) io->stop();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
  // Connections still open (a write stuck past the drain): closed here, with no thread left to
  // race, so each lets go of its session (they hold each other until the close).
  {
    std::vector<std::shared_ptr<Connection>> stuck;
    {
      MutexLock lock(&conns_mu_);
      for (auto& [id, weak] : conns_) {
        if (auto c = weak.lock()) stuck.push_back(c);
      }
    }
    for (auto& c : stuck) c->CloseNow();
  }
  // Parked collectives' waiters hold closed connections' sessions (and their timers and sockets):
  // they go now, while the I/O contexts those belong to exist (the engine outlives them).
  engine()->DropRoundWaiters();
  if (ckpt_writer_.started()) {
    ckpt_writer_.Stop();  // finishes a pending write first
    // A last checkpoint at clean exit, if the state is at a step boundary. (A cluster writes its
    // final one when the job ends: one shard alone cannot seal a checkpoint.)
    // Not from a daemon that never became ready: its state is empty or half restored (a restore
    // refused), and written as the newest checkpoint it would hide, and prune, the good ones.
    auto snap = coordinator_ || !became_ready_.load() ? std::nullopt : engine()->SnapshotIfAtBoundary();
    if (snap) {
      if (snap->step != last_checkpoint_step_.load()) WriteSnapshot(*snap);
    } else if (!coordinator_ && became_ready_.load()) {
      spdlog::warn("a step was in progress at exit; the newest checkpoint stays at step {}",
                   last_checkpoint_step_.load());
    }
  }
  if (accepting_) LogSummary();  // (not after a start that failed: nothing ran to sum up)
}

}  // namespace psd::server
