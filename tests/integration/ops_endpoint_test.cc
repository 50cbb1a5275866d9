// The operator endpoints of an in-process psd (--metrics-port 0): probes, Prometheus metrics that
// follow the job, the status JSON and page, the token on everything but the probes, readiness of
// a cluster shard (the port file only once the cluster serves), version and uptime in status.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <thread>

#include "support/http_get.h"
#include "support/test_server.h"

using namespace psd;
using psd::testing::ConnectWorker;
using psd::testing::HttpGet;
using psd::testing::StartServer;
using psd::testing::TestConfig;

namespace {

// The value of the first sample whose line starts with `series` (name{labels}), or -1.
double Sample(const std::string& metrics, const std::string& series) {
  size_t at = 0;
  while ((at = metrics.find(series + " ", at)) != std::string::npos) {
    if (at == 0 || metrics[at - 1] == '\n') return std::stod(metrics.substr(at + series.size() + 1));
    at += series.size();
  }
  return -1;
}

// One worker's push of step `local_step` and its token: "" or what failed. No Catch macro here:
// it runs on two threads at once, and Catch's message stack is not thread-safe.
std::string Step(psclient::Client& c, int64_t local_step) {
  float g = 1;
  auto out = c.Push(local_step, {{"v", {&g, DType::kFloat32, {}, MemoryKind::kHost}}}, /*wait_token=*/true, 10000);
  if (!out.ok()) return out.status().ToString();
  return out->token_status.ok() ? "" : out->token_status.ToString();
}

uint16_t FreePort() {
  asio::io_context io;
  tcp::acceptor a(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  return a.local_endpoint().port();
}

}  // namespace

TEST_CASE("ops endpoint: probes, metrics that follow the job, status JSON and page") {
  auto cfg = TestConfig(2, 2, 0);
  cfg.metrics_port = 0;
  auto server = StartServer(cfg);
  uint16_t mp = server->metrics_port();
  REQUIRE(mp != 0);
  REQUIRE(HttpGet(mp, "/healthz").status == 200);
  auto ready = HttpGet(mp, "/readyz");
  REQUIRE(ready.status == 200);
  REQUIRE(ready.body == "ready\n");
  REQUIRE(HttpGet(mp, "/nope").status == 404);

  auto a = ConnectWorker(server->port(), "w0");
  auto b = ConnectWorker(server->port(), "w1");
  float zero = 0;
  REQUIRE(a->CreateVariable("v", {&zero, DType::kFloat32, {}, MemoryKind::kHost}).ok());
  for (int64_t s = 0; s < 3; ++s) {
    std::string from_b;
    std::thread t([&] { from_b = Step(*b, s); });
    std::string from_a = Step(*a, s);
    t.join();
    REQUIRE(from_a == "");
    REQUIRE(from_b == "");
  }

  auto m = HttpGet(mp, "/metrics");
  REQUIRE(m.status == 200);
  REQUIRE(m.headers.find("text/plain; version=0.0.4") != std::string::npos);
  INFO(m.body);
  REQUIRE(Sample(m.body, "psd_global_step{shard=\"0\"}") == 3);
  REQUIRE(Sample(m.body, "psd_worker_pushes_accepted_total{shard=\"0\",worker=\"w0\"}") == 3);
  REQUIRE(Sample(m.body, "psd_worker_pushes_accepted_total{shard=\"0\",worker=\"w1\"}") == 3);
  REQUIRE(Sample(m.body, "psd_worker_pushes_stale_total{shard=\"0\",worker=\"w1\"}") == 0);
  REQUIRE(Sample(m.body, "psd_pushes_accepted_total{shard=\"0\"}") == 6);
  REQUIRE(Sample(m.body, "psd_token_wait_seconds_count{shard=\"0\"}") == 6);
  REQUIRE(Sample(m.body, "psd_step_duration_seconds_count{shard=\"0\"}") == 2);  // between 3 commits
  REQUIRE(Sample(m.body, "psd_apply_duration_seconds_count{shard=\"0\"}") == 3);
  REQUIRE(Sample(m.body, "psd_step_gradients_min{shard=\"0\"}") == 2);
  REQUIRE(Sample(m.body, "psd_variables{shard=\"0\"}") == 1);
  REQUIRE(Sample(m.body, "psd_connections{shard=\"0\"}") == 2);
  REQUIRE(Sample(m.body, "psd_workers{shard=\"0\",state=\"connected\"}") == 2);
  REQUIRE(Sample(m.body, "psd_worker_chief{shard=\"0\",worker=\"w0\"}") == 1);
  REQUIRE(Sample(m.body, "psd_received_bytes_total{shard=\"0\"}") > 0);
  REQUIRE(Sample(m.body, "psd_sent_bytes_total{shard=\"0\"}") > 0);
  REQUIRE(Sample(m.body, "psd_ready{shard=\"0\"}") == 1);
  REQUIRE(Sample(m.body, "process_resident_memory_bytes{shard=\"0\"}") > 1e6);
  REQUIRE(m.body.find("psd_build_info{shard=\"0\",version=\"" + std::string(server::kPsdVersion) + "\"} 1") !=
          std::string::npos);

  auto j = HttpGet(mp, "/status.json");
  REQUIRE(j.status == 200);
  REQUIRE(j.headers.find("application/json") != std::string::npos);
  REQUIRE(j.body.find("\"global_step\":3,") != std::string::npos);
  REQUIRE(j.body.find("\"name\":\"w0\",\"state\":\"connected\",\"chief\":true,\"accepted\":3,\"stale\":0") !=
          std::string::npos);
  REQUIRE(j.body.find("\"placement\":[{\"name\":\"v\"") != std::string::npos);
  // The listing is kept between requests (the page asks every second), and taken again once a
  // variable is added.
  REQUIRE(a->CreateVariable("v2", {&zero, DType::kFloat32, {}, MemoryKind::kHost},
                            [] {
                              psclient::VariableOptions o;
                              o.trainable = false;
                              return o;
                            }())
              .ok());
  CHECK(HttpGet(mp, "/status.json").body.find("{\"name\":\"v2\"") != std::string::npos);
  auto page = HttpGet(mp, "/");
  REQUIRE(page.status == 200);
  REQUIRE(page.body.find("<title>psd status</title>") != std::string::npos);
  REQUIRE(page.body.find("https://") == std::string::npos);  // self-contained: nothing from a CDN

  auto st = a->GetStatus();
  REQUIRE(st.ok());
  REQUIRE(st->version == server::kPsdVersion);
  REQUIRE(st->ready);
  REQUIRE(st->uptime_s > 0);
  REQUIRE(st->cluster_state == "running");

  // A restore replaces the engine (a cluster does at every re-formation): the process's counters
  // go on from where they were instead of falling back to 0.
  std::vector<server::VarPlacement> placements;
  REQUIRE(server->RestoreEngine(2, -1, &placements).ok());
  m = HttpGet(mp, "/metrics");
  REQUIRE(Sample(m.body, "psd_global_step{shard=\"0\"}") == 0);  // an empty state
  REQUIRE(Sample(m.body, "psd_pushes_accepted_total{shard=\"0\"}") == 6);
  REQUIRE(HttpGet(mp, "/status.json").body.find("\"accepted\":6,") != std::string::npos);
}

TEST_CASE("ops endpoint: the token guards everything but the probes") {
  auto cfg = TestConfig(1);
  cfg.metrics_port = 0;
  cfg.auth_token = "s3cret";
  auto server = StartServer(cfg);
  uint16_t mp = server->metrics_port();
  for (const char* path : {"/metrics", "/status.json", "/"}) {
    auto denied = HttpGet(mp, path);
    REQUIRE(denied.status == 401);
    REQUIRE(denied.headers.find("WWW-Authenticate: Basic") != std::string::npos);
    REQUIRE(HttpGet(mp, path, "Authorization: Bearer wrong\r\n").status == 401);
    REQUIRE(HttpGet(mp, path, "Authorization: Bearer s3cret\r\n").status == 200);
    // The scheme is case-insensitive (RFC 7235); spaces before the credentials are not part of them.
    REQUIRE(HttpGet(mp, path, "Authorization: bearer s3cret\r\n").status == 200);
    REQUIRE(HttpGet(mp, path, "Authorization: BEARER  s3cret\r\n").status == 200);
    REQUIRE(HttpGet(mp, path, "Authorization: Bearers3cret\r\n").status == 401);
    // Basic, as a browser sends it: base64("admin:s3cret").
    REQUIRE(HttpGet(mp, path, "Authorization: Basic YWRtaW46czNjcmV0\r\n").status == 200);
  }
  REQUIRE(HttpGet(mp, "/healthz").status == 200);
  REQUIRE(HttpGet(mp, "/readyz").status == 200);
}

TEST_CASE("a cluster shard is ready, and writes its port file, only once the cluster serves") {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("psd-ready-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (int attempt = 0;; ++attempt) {
    REQUIRE(attempt < 5);
    std::vector<uint16_t> ports{FreePort(), FreePort()};
    if (ports[0] == ports[1]) continue;
    auto cfg = TestConfig(1);
    cfg.cluster = {"127.0.0.1:" + std::to_string(ports[0]), "127.0.0.1:" + std::to_string(ports[1])};
    cfg.metrics_port = 0;
    cfg.election_timeout_ms = 300;
    std::vector<std::unique_ptr<server::Server>> shards;
    auto start = [&](int k) {
      auto c = cfg;
      c.shard_index = k;
      c.port = ports[static_cast<size_t>(k)];
      c.port_file = (dir / ("port" + std::to_string(k))).string();
      auto s = server::Server::Create(c);
      REQUIRE(s.ok());
      if (!(*s)->Start().ok()) return false;  // the port was taken meanwhile: try others
      shards.push_back(std::move(*s));
      return true;
    };
    if (!start(0)) continue;
    uint16_t mp0 = shards[0]->metrics_port();
    // Alone, shard 0 cannot form the cluster: not ready, no port file, and /readyz says why.
    std::this_thread::sleep_for(std::chrono::milliseconds(700));
    auto r = HttpGet(mp0, "/readyz");
    REQUIRE(r.status == 503);
    REQUIRE(r.body.find("shard 1") != std::string::npos);
    REQUIRE_FALSE(fs::exists(dir / "port0"));
    REQUIRE(HttpGet(mp0, "/healthz").status == 200);  // alive all the same
    if (!start(1)) continue;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!(fs::exists(dir / "port0") && fs::exists(dir / "port1")) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // What each shard says when the cluster has not formed (a failure then shows why).
    INFO("shard 0 /readyz: " << HttpGet(mp0, "/readyz").body
                             << "; shard 1 /readyz: " << HttpGet(shards[1]->metrics_port(), "/readyz").body);
    REQUIRE(fs::exists(dir / "port0"));
    REQUIRE(fs::exists(dir / "port1"));
    std::ifstream f(dir / "port0");
    int written = 0;
    f >> written;
    REQUIRE(written == ports[0]);
    REQUIRE(HttpGet(mp0, "/readyz").status == 200);
    REQUIRE(HttpGet(shards[1]->metrics_port(), "/readyz").status == 200);
    auto m = HttpGet(mp0, "/metrics").body;
    REQUIRE(Sample(m, "psd_cluster_missing_shards{shard=\"0\"}") == 0);
    REQUIRE(Sample(m, "psd_cluster_shards{shard=\"0\"}") == 2);
    break;
  }
  fs::remove_all(dir);
}
