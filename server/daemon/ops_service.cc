#include "daemon/ops_service.h"

#include <dirent.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cctype>
#include <fstream>
#include <sstream>

#include "core/buffer.h"
#include "daemon/server.h"
#include "daemon/status_page.h"
#include "ops/text_format.h"
#include "psd/secret.h"
#include "service/values_segment.h"
#include "text/json.h"

namespace psd::server::ops {
namespace {

struct ProcessFigures {
  double rss_bytes = 0;
  double cpu_seconds = 0;
  double open_fds = 0;
  double max_fds = 0;
};

ProcessFigures ReadProcess() {
  ProcessFigures p;
  long page = sysconf(_SC_PAGESIZE);
  std::ifstream statm("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  if (statm >> size >> resident) p.rss_bytes = static_cast<double>(resident) * static_cast<double>(page);
  std::ifstream stat("/proc/self/stat");
  std::string line;
  if (std::getline(stat, line)) {
    // Fields after the command name (which may hold spaces) start after the last ')'.
    size_t close = line.rfind(')');
    if (close != std::string::npos) {
      std::istringstream rest(line.substr(close + 2));
      std::string field;
      double utime = 0, stime = 0;
      for (int i = 3; i <= 15 && rest >> field; ++i) {
        if (i == 14) utime = std::stod(field);
        if (i == 15) stime = std::stod(field);
      }
      p.cpu_seconds = (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
    }
  }
  if (DIR* d = opendir("/proc/self/fd")) {
    int n = 0;
    while (readdir(d) != nullptr) ++n;
    closedir(d);
    p.open_fds = std::max(0, n - 3);  // ".", ".." and the directory's own fd
  }
  p.max_fds = static_cast<double>(sysconf(_SC_OPEN_MAX));
  return p;
}

HttpResponse Text(int status, std::string body) { return {status, "text/plain; charset=utf-8", std::move(body), {}}; }

const char* WorkerState(const WorkerInfo& w) {
  if (w.finished) return "finished";
  if (w.lost) return "lost";
  return w.connected ? "connected" : "disconnected";
}

}  // namespace

bool Base64Decode(std::string_view in, std::string* out) {
  out->clear();
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const char c = in[i];
    int v;
    if (c >= 'A' && c <= 'Z') {
      v = c - 'A';
    } else if (c >= 'a' && c <= 'z') {
      v = c - 'a' + 26;
    } else if (c >= '0' && c <= '9') {
      v = c - '0' + 52;
    } else if (c == '+') {
      v = 62;
    } else if (c == '/') {
      v = 63;
    } else if (c == '=') {  // padding: only at the end, at most two
      return in.size() - i <= 2 && in.find_first_not_of('=', i) == std::string_view::npos;
    } else {
      return false;
    }
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out->push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return true;
}

OpsService::OpsService(Server& server, asio::io_context& io) : server_(server), io_(io), sample_timer_(io) {}

OpsService::~OpsService() = default;

Status OpsService::Start() {
  const ServerConfig& cfg = server_.config();
  if (cfg.metrics_port >= 0) {
    http_ = std::make_unique<HttpServer>(io_, [this](const HttpRequest& r) { return Handle(r); });
    PSD_RETURN_IF_ERROR(http_->Listen(cfg.metrics_host, static_cast<uint16_t>(cfg.metrics_port)));
    if (!cfg.metrics_port_file.empty()) {
      std::string tmp = cfg.metrics_port_file + ".tmp";
      {
        std::ofstream f(tmp);
        f << http_->port() << "\n";
        if (!f) return Unavailable("cannot write --metrics-port-file " + cfg.metrics_port_file);
      }
      if (std::rename(tmp.c_str(), cfg.metrics_port_file.c_str()) != 0) {
        return Unavailable("cannot write --metrics-port-file " + cfg.metrics_port_file);
      }
    }
    const bool v6 = cfg.metrics_host.find(':') != std::string::npos;  // a URL writes it in brackets
    spdlog::info("metrics, status page and probes on http://{}{}{}:{}/ (/metrics /healthz /readyz){}", v6 ? "[" : "",
                 cfg.metrics_host, v6 ? "]" : "", http_->port(),
                 cfg.auth_token.empty() ? "" : "; the token is needed for all but the probes");
  }
  server_.metrics().AddSample(UnixNow(), server_.engine()->global_step());
  ScheduleSample();
  return Status::Ok();
}

void OpsService::Stop() {
  if (http_) http_->Stop();
  asio::post(io_, [this] { sample_timer_.cancel(); });
}

void OpsService::ScheduleSample() {
  sample_timer_.expires_after(std::chrono::seconds(1));
  sample_timer_.async_wait([this](boost::system::error_code ec) {
    if (ec) return;
    server_.metrics().AddSample(UnixNow(), server_.engine()->global_step());
    ScheduleSample();
  });
}

bool OpsService::Authorized(const HttpRequest& req) const {
  const std::string& token = server_.config().auth_token;
  if (token.empty()) return true;
  std::string auth = req.Header("authorization");
  // "<scheme> <credentials>": the scheme is case-insensitive (RFC 7235), spaces around are not part of the credentials.
  std::string_view v(auth);
  const size_t sp = v.find(' ');
  if (sp == std::string_view::npos) return false;
  std::string scheme(v.substr(0, sp));
  for (char& c : scheme) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  v.remove_prefix(sp);
  while (!v.empty() && v.front() == ' ') v.remove_prefix(1);
  if (scheme == "bearer") return SecretsEqual(token, v);
  if (scheme == "basic") {
    std::string decoded;
    if (!Base64Decode(v, &decoded)) return false;
    size_t colon = decoded.find(':');
    return colon != std::string::npos && SecretsEqual(token, std::string_view(decoded).substr(colon + 1));
  }
  return false;
}

HttpResponse OpsService::Handle(const HttpRequest& req) {
  if (req.path == "/healthz") return Text(200, "ok\n");
  if (req.path == "/readyz") {
    Status s = server_.Serving();
    return s.ok() ? Text(200, "ready\n") : Text(503, "not ready: " + s.message() + "\n");
  }
  if (req.path != "/" && req.path != "/metrics" && req.path != "/status.json") {
    return Text(404, "not found; try /, /metrics, /status.json, /healthz or /readyz\n");
  }
  if (!Authorized(req)) {
    HttpResponse r = Text(401, "this psd runs with --auth-token-file: send Authorization: Bearer <token>\n");
    r.headers.push_back({"WWW-Authenticate", "Basic realm=\"psd\", charset=\"UTF-8\""});
    return r;
  }
  if (req.path == "/metrics") return {200, "text/plain; version=0.0.4; charset=utf-8", RenderMetrics(), {}};
  if (req.path == "/status.json") return {200, "application/json", RenderStatusJson(), {}};
  HttpResponse page{200, "text/html; charset=utf-8", kStatusPageHtml, {}};
  page.headers.push_back({"Content-Security-Policy",
                          "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                          "connect-src 'self'; img-src 'self' data:"});
  return page;
}

std::string OpsService::RenderMetrics() const {
  const Labels own{{"shard", std::to_string(server_.config().shard_index)}};
  PrometheusWriter w(own);
  WriteDaemonMetrics(w, server_);
  // A stand-in this shard runs for its predecessor (takeover): its figures too, labelled with the
  // shard it serves.
  server_.WithStandIn([&](Server& stand_in) {
    w.SetCommon(Labels{{"shard", std::to_string(stand_in.config().shard_index)}, {"stand_in", "true"}});
    WriteDaemonMetrics(w, stand_in);
  });
  w.SetCommon(own);
  // The process's own figures, once (a stand-in shares them): its values segment, kept storage.
  if (const ValuesSegment* values = ValuesSegment::Current()) {
    w.Gauge("psd_values_segment_bytes", "bytes of the values segment in psd's buffers now (this process)",
            static_cast<double>(values->in_use()));
  }
  const RecycledBuffers kept = RecycledBufferStats();
  w.Gauge("psd_tensor_storage_kept_bytes", "storage of big tensor buffers (32 MiB and up) let go and kept for reuse",
          static_cast<double>(kept.held_bytes));
  w.Counter("psd_tensor_storage_reused_total", "big tensor buffers given kept storage instead of fresh pages",
            static_cast<double>(kept.reused));
  ProcessFigures p = ReadProcess();
  w.Gauge("process_resident_memory_bytes", "resident memory size in bytes", p.rss_bytes);
  w.Counter("process_cpu_seconds_total", "user and system CPU time in seconds", p.cpu_seconds);
  w.Gauge("process_open_fds", "open file descriptors", p.open_fds);
  w.Gauge("process_max_fds", "the file descriptor limit", p.max_fds);
  w.Gauge("process_start_time_seconds", "start time of the process since the Unix epoch", server_.start_unix_s());
  return w.text();
}

void OpsService::WriteDaemonMetrics(PrometheusWriter& w, Server& server) {
  const ServerConfig& cfg = server.config();
  Metrics& m = server.metrics();
  auto engine = server.engine();
  EngineStats st = server.Stats();

  w.Gauge("psd_build_info", "psd's version (the value is always 1)", 1, {{"version", kPsdVersion}});
  w.Gauge("psd_ready", "1 once restored, formed and serving workers", server.Serving().ok() ? 1 : 0);
  w.Gauge("psd_uptime_seconds", "seconds since psd started", server.uptime_s());
  w.Gauge("psd_global_step", "the global step (steps committed)", static_cast<double>(st.global_step));
  w.Gauge("psd_step_rate_steps_per_second", "global steps per second over the last 10 s", m.StepRate(10));
  w.Histo("psd_step_duration_seconds", "time between consecutive step commits", m.step_seconds().Read());
  w.Histo("psd_token_wait_seconds", "how long a worker's token wait (the barrier) was parked",
          m.token_wait_seconds().Read());
  w.Histo("psd_apply_duration_seconds", "optimizer apply time per variable", m.apply_seconds().Read());
  w.Gauge("psd_tokens_queued", "tokens in the queue", static_cast<double>(st.tokens_queued));
  w.Gauge("psd_replicas_required", "fresh gradients per variable a step needs now", st.required_replicas);
  w.Gauge("psd_step_gradients_min", "fewest gradients averaged into one variable in the last step",
          m.last_step_min_gradients());
  w.Gauge("psd_step_gradients_max", "most gradients averaged into one variable in the last step",
          m.last_step_max_gradients());
  w.Counter("psd_step_gradients_total", "gradients used by committed steps (per step: the fewest of any variable)",
            static_cast<double>(m.gradients_used()));
  w.Counter("psd_steps_forced_total", "steps committed by --step-deadline-ms", static_cast<double>(m.steps_forced()));
  w.Counter("psd_pushes_accepted_total", "gradients accepted (all workers)", static_cast<double>(st.accepted));
  w.Counter("psd_pushes_stale_total", "gradients dropped as stale (all workers)", static_cast<double>(st.stale));
  w.Gauge("psd_max_staleness_steps", "async/ssp: the largest staleness seen", static_cast<double>(st.max_staleness));
  w.Gauge("psd_learning_rate", "the learning rate of the next steps", engine->learning_rate());

  auto workers = server.workers().Snapshot();
  auto figures = m.Workers();
  WorkerCounts wc = server.workers().Counts();
  w.Gauge("psd_workers", "workers by state", wc.connected, {{"state", "connected"}});
  w.Gauge("psd_workers", "workers by state", wc.finished, {{"state", "finished"}});
  w.Gauge("psd_workers", "workers by state", wc.lost, {{"state", "lost"}});
  for (size_t i = 0; i < workers.size(); ++i) {
    const WorkerInfo& wi = workers[i];
    WorkerFigures f = i < figures.size() ? figures[i] : WorkerFigures{};
    Labels l{{"worker", wi.name}};
    w.Counter("psd_worker_pushes_accepted_total", "gradients accepted from this worker",
              static_cast<double>(f.pushes_accepted), l);
    w.Counter("psd_worker_pushes_stale_total", "gradients from this worker dropped as stale",
              static_cast<double>(f.pushes_stale), l);
    w.Gauge("psd_worker_staleness_steps", "global step - local step of this worker's newest push",
            static_cast<double>(f.last_staleness), l);
    w.Gauge(
        "psd_worker_lag_steps", "global step - this worker's newest local step (-1: no push yet)",
        f.last_local_step < 0 ? -1.0 : static_cast<double>(std::max<int64_t>(0, st.global_step - f.last_local_step)),
        l);
    w.Gauge("psd_worker_last_seen_timestamp_seconds", "Unix time of this worker's newest request", f.last_seen_unix_s,
            l);
    w.Gauge("psd_worker_connected", "1 while this worker is connected", wi.connected ? 1 : 0, l);
    w.Gauge("psd_worker_chief", "1 for the chief worker", wi.chief ? 1 : 0, l);
  }

  w.Counter("psd_received_bytes_total", "bytes received on the data port", static_cast<double>(m.bytes_in()));
  w.Counter("psd_sent_bytes_total", "bytes sent on the data port", static_cast<double>(m.bytes_out()));
  w.Counter("psd_shm_bytes_total", "tensor bytes moved through same-host workers' shared memory",
            static_cast<double>(m.shm_bytes()));
  w.Counter("psd_shm_lanes_total", "same-host workers' connections whose frames moved to a shared-memory lane",
            static_cast<double>(m.lanes()));
  w.Counter("psd_values_in_place_bytes_total",
            "value bytes same-host workers pulled straight from the values segment (psd wrote none of them)",
            static_cast<double>(m.values_in_place_bytes()));
  if (server.config().replicas_per_shard > 1) {
    w.Counter("psd_replica_sent_bytes_total", "copies of shard state sent to other shards (serialized)",
              static_cast<double>(m.replica_sent()));
    w.Counter("psd_replica_received_bytes_total", "copies of other shards' state taken (serialized)",
              static_cast<double>(m.replica_received()));
    w.Counter(
        "psd_replica_rebuilt_total",
        "copies taken as a difference, rebuilt in place over a copy let go (replayed) or from a copy of their base",
        static_cast<double>(m.replica_replayed()), {{"how", "replayed"}});
    w.Counter("psd_replica_rebuilt_total", "", static_cast<double>(m.replica_from_base()), {{"how", "from_base"}});
    w.Counter("psd_replica_audits_total",
              "own copies whose checksum from the lists of changes was checked against every block (1 in 16)",
              static_cast<double>(m.replica_audits()));
    w.Counter("psd_replica_unlisted_writes_total",
              "audited copies with a write no list of changes named (a psd bug; the copy went whole)",
              static_cast<double>(m.replica_unlisted()));
    w.Gauge("psd_replica_own_bytes", "this shard's own kept copies (the newest shares the engine's buffers)",
            static_cast<double>(m.replica_own()));
    w.Gauge("psd_replica_held_bytes", "the predecessor shard's copies kept here",
            static_cast<double>(m.replica_held()));
    w.Counter("psd_stand_ins_started_total", "stand-ins this shard started for its predecessor (takeover)",
              static_cast<double>(m.stand_ins_started()));
    w.Gauge("psd_stand_in_running", "1 while this shard runs a stand-in for its predecessor",
            m.stand_in_running() ? 1.0 : 0.0);
    if (ClusterCoordinator* c = server.coordinator()) {
      auto addresses = c->Addresses();
      int moved = 0;
      for (size_t i = 0; i < addresses.size() && i < server.config().cluster.size(); ++i) {
        if (addresses[i] != server.config().cluster[i]) ++moved;
      }
      w.Gauge("psd_shards_served_by_stand_ins", "shards served by a stand-in now, as this shard knows it",
              static_cast<double>(moved));
    }
  }
  if (ShmListener* shm = server.shm()) {
    w.Counter("psd_shm_attached_total", "shared-memory segments attached by same-host workers",
              static_cast<double>(shm->attached()));
    w.Counter("psd_shm_refused_total", "shared-memory segments refused (bad nonce, unsealed, too big)",
              static_cast<double>(shm->refused()));
  }
  w.Gauge("psd_connections", "open connections on the data port", server.connection_count());
  w.Counter("psd_connections_accepted_total", "connections accepted", static_cast<double>(m.connections_accepted()));
  w.Counter("psd_connections_refused_total", "connections refused by --max-connections",
            static_cast<double>(m.connections_refused()));
  const FrameBudget& budget = server.frame_budget();
  w.Gauge("psd_inflight_frame_bytes", "memory held by incoming frames now (all connections)",
          static_cast<double>(budget.in_use()));
  w.Gauge("psd_inflight_frame_bytes_peak", "the most memory incoming frames have held at once",
          static_cast<double>(budget.peak()));
  w.Gauge("psd_inflight_frame_bytes_limit", "--max-inflight-bytes", static_cast<double>(budget.limit()));
  w.Gauge("psd_inflight_frames_waiting", "frames waiting for their share of --max-inflight-bytes",
          static_cast<double>(budget.waiting()));
  w.Counter("psd_inflight_frame_waits_total", "frames that had to wait for their share of --max-inflight-bytes",
            static_cast<double>(budget.waits()));
  const FramePool& pool = server.frame_pool();
  w.Gauge("psd_frame_buffer_bytes", "memory of incoming frames' buffers of 64 KiB and up, by state",
          static_cast<double>(pool.handed_out_bytes()), {{"state", "in_use"}});
  w.Gauge("psd_frame_buffer_bytes", "", static_cast<double>(pool.kept_bytes()), {{"state", "kept"}});
  w.Counter("psd_frame_buffer_maps_total", "frame buffers mapped from the kernel (the others were reused)",
            static_cast<double>(pool.maps()));
  w.Counter("psd_frame_timeouts_total", "connections closed because a frame did not arrive within --frame-timeout-ms",
            static_cast<double>(m.frame_timeouts()));
  w.Counter("psd_reads_paused_total",
            "times psd stopped reading a connection without a hello, or an observer's, until its unread replies "
            "went out",
            static_cast<double>(m.reads_paused()));
  w.Gauge("psd_variables", "variables (or variable slices) held by this shard", st.variables);
  w.Gauge("psd_model_bytes", "bytes the variables of this shard account for (values, slots, averages, buffers)",
          static_cast<double>(st.model_bytes));

  Metrics::CheckpointFigures c = m.Checkpoints();
  w.Histo("psd_checkpoint_write_duration_seconds", "time to write this shard's checkpoint part",
          m.checkpoint_write_seconds().Read());
  w.Gauge("psd_checkpoint_last_step", "global step of the newest checkpoint written (-1: none)",
          static_cast<double>(server.last_checkpoint_step()));
  w.Gauge("psd_checkpoint_last_bytes", "size of the newest checkpoint part written", static_cast<double>(c.last_bytes));
  w.Gauge("psd_checkpoint_last_timestamp_seconds", "Unix time of the newest checkpoint written", c.last_unix_s);
  w.Counter("psd_checkpoints_written_total", "checkpoint parts written", static_cast<double>(c.written));
  w.Counter("psd_checkpoints_failed_total", "checkpoint writes that failed", static_cast<double>(c.failed));
  w.Gauge("psd_restore_duration_seconds", "time the start-up restore took (0: none)", c.restore_seconds);

  if (ClusterCoordinator* co = server.coordinator()) {
    auto v = co->Describe();
    w.Gauge("psd_cluster_shards", "shards in the cluster", cfg.shards());
    w.Gauge("psd_cluster_term", "election term", static_cast<double>(v.term));
    w.Gauge("psd_cluster_epoch", "cluster epoch (bumped at every formation)", static_cast<double>(v.epoch));
    w.Gauge("psd_cluster_chief_shard", "the chief shard (-1: none)", v.chief);
    w.Gauge("psd_cluster_is_chief", "1 on the chief shard", v.chief == cfg.shard_index ? 1 : 0);
    w.Gauge("psd_cluster_missing_shards", "shards the cluster waits for", static_cast<double>(v.missing.size()));
    for (int k = 0; k < cfg.shards(); ++k) {
      bool missing = std::find(v.missing.begin(), v.missing.end(), k) != v.missing.end();
      w.Gauge("psd_cluster_shard_up", "1 if this shard sees shard k live", missing ? 0 : 1,
              {{"peer", std::to_string(k)}});
    }
  }
}

OpsService::PlacementListing OpsService::Placement(const void* engine, int64_t variables) const {
  const auto now = std::chrono::steady_clock::now();
  {
    MutexLock lock(&placement_mu_);
    if (placement_.engine == engine && placement_.variables == variables && now - placement_.at < kPlacementMaxAge) {
      return placement_;
    }
  }
  PlacementListing fresh;
  fresh.engine = engine;
  fresh.variables = variables;
  fresh.at = now;
  std::vector<VarPlacement> all;
  fresh.whole = server_.PlacementMap(&all, &fresh.shard_bytes).ok();
  if (!fresh.whole) {
    all = server_.engine()->Placements(server_.config().shard_index);
    fresh.shard_bytes.clear();
  }
  fresh.truncated = all.size() > kMaxListed;
  if (fresh.truncated) all.erase(all.begin() + static_cast<std::ptrdiff_t>(kMaxListed), all.end());
  fresh.listed = std::move(all);
  MutexLock lock(&placement_mu_);
  placement_ = fresh;
  return fresh;
}

std::string OpsService::RenderStatusJson() const {
  const ServerConfig& cfg = server_.config();
  Metrics& m = server_.metrics();
  auto engine = server_.engine();
  EngineStats st = server_.Stats();
  Status serving = server_.Serving();
  text::JsonWriter j;
  j.BeginObject();
  j.Key("version").String(kPsdVersion);
  j.Key("now").Number(UnixNow());
  j.Key("uptime_s").Number(server_.uptime_s());
  j.Key("ready").Bool(serving.ok());
  j.Key("state").String(serving.ok() ? "serving" : serving.message());
  j.Key("shard").Int(cfg.shard_index);
  j.Key("shards").Int(cfg.shards());
  j.Key("mode").String(ModeName(cfg.mode));
  j.Key("replicas_to_aggregate").Int(cfg.replicas_to_aggregate);
  j.Key("total_replicas").Int(cfg.total_replicas);
  j.Key("optimizer").String(engine->optimizer().name());
  j.Key("learning_rate").Number(engine->learning_rate());
  j.Key("global_step").Int(st.global_step);
  j.Key("step_rate").Number(m.StepRate(10));
  j.Key("tokens_queued").Int(st.tokens_queued);
  j.Key("replicas_required").Int(st.required_replicas);
  j.Key("last_step_gradients").Int(st.last_step_gradients);
  j.Key("accepted").Int(st.accepted);
  j.Key("stale").Int(st.stale);
  j.Key("max_staleness").Int(st.max_staleness);
  j.Key("variables").Int(st.variables);
  j.Key("model_bytes").Int(static_cast<int64_t>(st.model_bytes));
  j.Key("connections").Int(server_.connection_count());
  j.Key("bytes_in").Int(static_cast<int64_t>(m.bytes_in()));
  j.Key("bytes_out").Int(static_cast<int64_t>(m.bytes_out()));
  j.Key("shm_bytes").Int(static_cast<int64_t>(m.shm_bytes()));
  j.Key("values_in_place_bytes").Int(static_cast<int64_t>(m.values_in_place_bytes()));
  j.Key("shm_lanes").Int(static_cast<int64_t>(m.lanes()));
  j.Key("shm_attached").Int(static_cast<int64_t>(server_.shm() ? server_.shm()->attached() : 0));
  j.Key("inflight_frame_bytes").Int(static_cast<int64_t>(server_.frame_budget().in_use()));
  j.Key("inflight_frame_bytes_limit").Int(static_cast<int64_t>(server_.frame_budget().limit()));
  j.Key("frame_buffer_bytes")
      .Int(static_cast<int64_t>(server_.frame_pool().handed_out_bytes() + server_.frame_pool().kept_bytes()));
  j.Key("rss_bytes").Number(ReadProcess().rss_bytes);

  j.Key("history").BeginArray();
  for (const Metrics::Sample& s : m.History()) j.BeginArray().Number(s.unix_s).Int(s.step).EndArray();
  j.EndArray();

  auto workers = server_.workers().Snapshot();
  auto figures = m.Workers();
  double now = UnixNow();
  j.Key("workers").BeginArray();
  for (size_t i = 0; i < workers.size(); ++i) {
    const WorkerInfo& wi = workers[i];
    WorkerFigures f = i < figures.size() ? figures[i] : WorkerFigures{};
    j.BeginObject();
    j.Key("id").Int(static_cast<int64_t>(i));
    j.Key("name").String(wi.name);
    j.Key("state").String(WorkerState(wi));
    j.Key("chief").Bool(wi.chief);
    j.Key("accepted").Int(static_cast<int64_t>(f.pushes_accepted));
    j.Key("stale").Int(static_cast<int64_t>(f.pushes_stale));
    j.Key("local_step").Int(f.last_local_step);
    if (f.last_local_step >= 0) {
      j.Key("lag").Int(std::max<int64_t>(0, st.global_step - f.last_local_step));
    } else {
      j.Key("lag").Null();
    }
    j.Key("staleness").Int(f.last_staleness);
    j.Key("max_staleness").Int(f.max_staleness);
    if (f.last_seen_unix_s > 0) {
      j.Key("last_seen_s").Number(std::max(0.0, now - f.last_seen_unix_s));
    } else {
      j.Key("last_seen_s").Null();
    }
    j.EndObject();
  }
  j.EndArray();

  j.Key("cluster");
  if (ClusterCoordinator* co = server_.coordinator()) {
    auto v = co->Describe();
    j.BeginObject();
    j.Key("chief").Int(v.chief);
    j.Key("term").Int(static_cast<int64_t>(v.term));
    j.Key("epoch").Int(static_cast<int64_t>(v.epoch));
    j.Key("state").String(v.state);
    j.Key("missing").BeginArray();
    for (int k : v.missing) j.Int(k);
    j.EndArray();
    j.EndObject();
  } else {
    j.Null();
  }

  // A stand-in this shard runs for its predecessor (takeover): what it serves, read under the
  // host's lock as /metrics reads it.
  j.Key("stand_in");
  bool stand_in = false;
  server_.WithStandIn([&](Server& si) {
    stand_in = true;
    Status si_serving = si.Serving();
    EngineStats si_st = si.Stats();
    j.BeginObject();
    j.Key("shard").Int(si.config().shard_index);
    j.Key("ready").Bool(si_serving.ok());
    j.Key("state").String(si_serving.ok() ? "serving" : si_serving.message());
    j.Key("global_step").Int(si_st.global_step);
    j.Key("variables").Int(si_st.variables);
    j.Key("connections").Int(si.connection_count());
    j.Key("bytes_in").Int(static_cast<int64_t>(si.metrics().bytes_in()));
    j.Key("bytes_out").Int(static_cast<int64_t>(si.metrics().bytes_out()));
    j.EndObject();
  });
  if (!stand_in) j.Null();

  Metrics::CheckpointFigures c = m.Checkpoints();
  j.Key("checkpoint").BeginObject();
  j.Key("dir").String(cfg.checkpoint_dir);
  j.Key("last_step").Int(server_.last_checkpoint_step());
  j.Key("last_seconds").Number(c.last_seconds);
  j.Key("last_bytes").Int(static_cast<int64_t>(c.last_bytes));
  j.Key("written").Int(static_cast<int64_t>(c.written));
  j.Key("failed").Int(static_cast<int64_t>(c.failed));
  j.Key("restored_step").Int(c.restored_step);
  j.Key("restore_seconds").Number(c.restore_seconds);
  j.EndObject();

  // The whole map on the chief (or a single daemon); this shard's own parts elsewhere.
  const PlacementListing placed = Placement(engine.get(), st.variables);
  j.Key("placement_complete").Bool(placed.whole);
  j.Key("shard_bytes").BeginArray();
  for (uint64_t b : placed.shard_bytes) j.Int(static_cast<int64_t>(b));
  j.EndArray();
  j.Key("placement_truncated").Bool(placed.truncated);
  j.Key("placement").BeginArray();
  for (const VarPlacement& p : placed.listed) {
    j.BeginObject();
    j.Key("name").String(p.name);
    j.Key("dtype").String(DTypeName(p.dtype));
    j.Key("shape").String(ShapeString(p.shape));
    j.Key("bytes").Int(static_cast<int64_t>(p.bytes()));
    j.Key("trainable").Bool(p.trainable);
    j.Key("parts").BeginArray();
    for (const SlicePart& part : p.parts) {
      j.BeginObject();
      j.Key("shard").Int(part.shard);
      j.Key("rows").BeginArray().Int(part.row_begin).Int(part.row_end).EndArray();
      j.EndObject();
    }
    j.EndArray();
    j.EndObject();
  }
  j.EndArray();
  j.EndObject();
  return j.text();
}

}  // namespace psd::server::ops
