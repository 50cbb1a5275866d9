// The operator endpoints' building blocks: histograms, the Prometheus text format, JSON, HTTP
// request parsing and the HTTP server's limits, base64 (Basic auth), sd_notify, the step rate.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "daemon/ops_service.h"
#include "ops/http_server.h"
#include "ops/metrics.h"
#include "ops/sd_notify.h"
#include "ops/text_format.h"
#include "support/http_get.h"
#include "text/json.h"

using namespace psd;
using namespace psd::server::ops;
using psd::testing::HttpExchange;

TEST_CASE("histogram buckets are cumulative with an +Inf bucket equal to the count") {
  Histogram h({0.1, 1, 10});
  for (double v : {0.05, 0.1, 0.5, 2.0, 20.0, 30.0}) h.Observe(v);
  auto s = h.Read();
  REQUIRE(s.cumulative == std::vector<uint64_t>{2, 3, 4, 6});  // 0.1 falls in le="0.1": bounds are inclusive
  REQUIRE(s.count == 6);
  REQUIRE(s.sum == Approx(52.65));
}

TEST_CASE("the Prometheus text format: HELP/TYPE once per family, labels escaped, histogram series") {
  PrometheusWriter w(Labels{{"shard", "1"}});
  w.Counter("psd_pushes_total", "pushes\nall", 3);
  w.Gauge("psd_worker_lag_steps", "lag", 2, {{"worker", "a\"b\\c\nd"}});
  w.Gauge("psd_worker_lag_steps", "lag", 5, {{"worker", "e"}});
  Histogram h({0.5, 1});
  h.Observe(0.25);
  h.Observe(2);
  w.Histo("psd_step_duration_seconds", "step time", h.Read());
  const std::string expected =
      "# HELP psd_pushes_total pushes\\nall\n"
      "# TYPE psd_pushes_total counter\n"
      "psd_pushes_total{shard=\"1\"} 3\n"
      "# HELP psd_worker_lag_steps lag\n"
      "# TYPE psd_worker_lag_steps gauge\n"
      "psd_worker_lag_steps{shard=\"1\",worker=\"a\\\"b\\\\c\\nd\"} 2\n"
      "psd_worker_lag_steps{shard=\"1\",worker=\"e\"} 5\n"
      "# HELP psd_step_duration_seconds step time\n"
      "# TYPE psd_step_duration_seconds histogram\n"
      "psd_step_duration_seconds_bucket{shard=\"1\",le=\"0.5\"} 1\n"
      "psd_step_duration_seconds_bucket{shard=\"1\",le=\"1\"} 1\n"
      "psd_step_duration_seconds_bucket{shard=\"1\",le=\"+Inf\"} 2\n"
      "psd_step_duration_seconds_sum{shard=\"1\"} 2.25\n"
      "psd_step_duration_seconds_count{shard=\"1\"} 2\n";
  REQUIRE(w.text() == expected);
}

TEST_CASE("the Prometheus text format: a second daemon's samples join their families' groups") {
  PrometheusWriter w(Labels{{"shard", "2"}});
  w.Gauge("psd_global_step", "step", 7);
  w.Gauge("psd_ready", "ready", 1);
  w.SetCommon(Labels{{"shard", "1"}, {"stand_in", "true"}});
  w.Gauge("psd_global_step", "step", 7);
  w.Gauge("psd_ready", "ready", 0);
  w.SetCommon(Labels{{"shard", "2"}});
  w.Gauge("process_open_fds", "fds", 9);
  REQUIRE(w.text() ==
          "# HELP psd_global_step step\n"
          "# TYPE psd_global_step gauge\n"
          "psd_global_step{shard=\"2\"} 7\n"
          "psd_global_step{shard=\"1\",stand_in=\"true\"} 7\n"
          "# HELP psd_ready ready\n"
          "# TYPE psd_ready gauge\n"
          "psd_ready{shard=\"2\"} 1\n"
          "psd_ready{shard=\"1\",stand_in=\"true\"} 0\n"
          "# HELP process_open_fds fds\n"
          "# TYPE process_open_fds gauge\n"
          "process_open_fds{shard=\"2\"} 9\n");
}

TEST_CASE("numbers in the text format") {
  REQUIRE(FormatNumber(3) == "3");
  REQUIRE(FormatNumber(-0.25) == "-0.25");
  REQUIRE(FormatNumber(1.0 / 0.0) == "+Inf");
  REQUIRE(FormatNumber(-1.0 / 0.0) == "-Inf");
  REQUIRE(FormatNumber(std::nan("")) == "NaN");
}

TEST_CASE("JSON: nesting, commas and escapes") {
  text::JsonWriter j;
  j.BeginObject();
  j.Key("a").Int(1);
  j.Key("s\"").String("x\n\t\x01\\");
  j.Key("l").BeginArray().Int(1).Bool(true).Null().Number(1.0 / 0.0).BeginArray().EndArray().EndArray();
  j.Key("o").BeginObject().EndObject();
  j.EndObject();
  REQUIRE(j.text() == R"({"a":1,"s\"":"x\n\t\u0001\\","l":[1,true,null,null,[]],"o":{}})");
}

TEST_CASE("HTTP request heads are parsed, and bad ones refused") {
  HttpRequest r;
  REQUIRE(ParseHttpRequest("GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAuthorization:  Bearer t \r\n\r\n", &r).ok());
  REQUIRE(r.method == "GET");
  REQUIRE(r.path == "/metrics");
  REQUIRE(r.query == "x=1");
  REQUIRE(r.Header("authorization") == "Bearer t");
  REQUIRE(r.Header("host") == "a");
  REQUIRE(r.Header("missing").empty());
  REQUIRE_FALSE(ParseHttpRequest("GET\r\n\r\n", &r).ok());
  REQUIRE_FALSE(ParseHttpRequest("GET /x HTTP/2\r\n\r\n", &r).ok());
  REQUIRE_FALSE(ParseHttpRequest("GET http://x/ HTTP/1.1\r\n\r\n", &r).ok());
  REQUIRE_FALSE(ParseHttpRequest("GET /x HTTP/1.1\r\nno colon\r\n\r\n", &r).ok());
  REQUIRE_FALSE(ParseHttpRequest("GET /\x01 HTTP/1.1\r\n\r\n", &r).ok());
}

TEST_CASE("HTTP responses carry length, no caching and close") {
  std::string s = SerializeHttpResponse({503, "text/plain", "not ready\n", {{"X-A", "b"}}}, false);
  REQUIRE(s.rfind("HTTP/1.1 503 Service Unavailable\r\n", 0) == 0);
  REQUIRE(s.find("Content-Length: 10\r\n") != std::string::npos);
  REQUIRE(s.find("Connection: close\r\n") != std::string::npos);
  REQUIRE(s.find("X-A: b\r\n") != std::string::npos);
  REQUIRE(s.substr(s.size() - 10) == "not ready\n");
  std::string head = SerializeHttpResponse({200, "text/plain", "abc", {}}, true);
  REQUIRE(head.substr(head.size() - 4) == "\r\n\r\n");  // HEAD: headers only
}

TEST_CASE("base64 for HTTP Basic auth") {
  std::string out;
  REQUIRE(Base64Decode("cHNkOnMzY3JldA==", &out));
  REQUIRE(out == "psd:s3cret");
  REQUIRE(Base64Decode("YQ", &out));
  REQUIRE(out == "a");
  REQUIRE_FALSE(Base64Decode("a b", &out));
  REQUIRE(Base64Decode("YQ==", &out));
  REQUIRE(out == "a");
  REQUIRE_FALSE(Base64Decode("YQ==garbage!!", &out));  // padding ends it: nothing may follow
  REQUIRE_FALSE(Base64Decode("Y===", &out));
}

TEST_CASE("sd_notify sends one datagram to $NOTIFY_SOCKET's path") {
  std::string path = (std::filesystem::temp_directory_path() / ("psd-notify-" + std::to_string(::getpid()))).string();
  ::unlink(path.c_str());
  int fd = ::socket(AF_UNIX, SOCK_DGRAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(SdNotify(path, "READY=1\nSTATUS=serving").ok());
  char buf[128] = {};
  ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
  REQUIRE(std::string(buf, n > 0 ? static_cast<size_t>(n) : 0) == "READY=1\nSTATUS=serving");
  ::close(fd);
  ::unlink(path.c_str());
  REQUIRE(SdNotify("", "READY=1").ok());                // not under systemd: nothing to do
  REQUIRE_FALSE(SdNotify("relative", "READY=1").ok());  // not a socket path
  REQUIRE_FALSE(SdNotify(path, "READY=1").ok());        // nobody listens there any more
}

TEST_CASE("the step rate is taken over the last samples of the window") {
  Metrics m;
  REQUIRE(m.StepRate(10) == 0);
  for (int i = 0; i <= 20; ++i) m.AddSample(1000.0 + i, 5 * i);  // 5 steps/s
  REQUIRE(m.StepRate(10) == Approx(5));
  m.AddSample(1021, 0);  // a restore moved the step back
  REQUIRE(m.StepRate(10) == 0);
  REQUIRE(m.History().size() == 22);
  for (int i = 0; i < 1000; ++i) m.AddSample(2000.0 + i, i);
  REQUIRE(m.History().size() == Metrics::kHistory);
}

TEST_CASE("per-worker figures accumulate by registry index") {
  Metrics m;
  m.OnPush(2, 7, 3, 1, 2);
  m.OnPush(2, 9, 2, 0, 0);
  m.OnWorkerRequest(0);
  auto w = m.Workers();
  REQUIRE(w.size() == 3);
  REQUIRE(w[2].pushes_accepted == 5);
  REQUIRE(w[2].pushes_stale == 1);
  REQUIRE(w[2].last_local_step == 9);
  REQUIRE(w[2].max_staleness == 2);
  REQUIRE(w[0].requests == 1);
  REQUIRE(w[0].last_seen_unix_s > 0);
  REQUIRE(w[1].last_local_step == -1);
  m.ResetWorker(2);  // another worker took index 2
  w = m.Workers();
  CHECK(w[2].pushes_accepted == 0);
  CHECK(w[2].last_local_step == -1);
  CHECK(w[2].max_staleness == 0);
  CHECK(w[0].requests == 1);
}

namespace {

// An HTTP server on 127.0.0.1 (a kernel-chosen port) answering "path=<path>", run on a thread of its own.
struct EchoHttp {
  explicit EchoHttp(HttpServer::Limits limits)
      : http(
            io, [](const HttpRequest& r) { return HttpResponse{200, "text/plain", "path=" + r.path, {}}; }, limits) {
    REQUIRE(http.Listen("127.0.0.1", 0).ok());
    REQUIRE(http.port() != 0);
    thread = std::thread([this] { io.run(); });
  }
  ~EchoHttp() {
    http.Stop();
    guard.reset();
    io.stop();
    thread.join();
  }
  uint16_t port() const { return http.port(); }
  asio::io_context io;
  HttpServer http;
  asio::executor_work_guard<asio::io_context::executor_type> guard = asio::make_work_guard(io);
  std::thread thread;
};

}  // namespace

TEST_CASE("the HTTP server answers, refuses other methods and huge heads, and cuts off silent clients") {
  HttpServer::Limits limits;
  limits.header_timeout = std::chrono::milliseconds(300);
  limits.max_header_bytes = 1024;
  EchoHttp server(limits);
  HttpServer& http = server.http;

  std::string ok = HttpExchange(http.port(), "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
  REQUIRE(ok.rfind("HTTP/1.1 200 OK", 0) == 0);
  REQUIRE(ok.substr(ok.size() - 11) == "path=/hello");
  REQUIRE(HttpExchange(http.port(), "POST / HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 405", 0) == 0);
  REQUIRE(HttpExchange(http.port(), "garbage\r\n\r\n").rfind("HTTP/1.1 400", 0) == 0);
  REQUIRE(HttpExchange(http.port(), "GET / HTTP/1.1\r\nX: " + std::string(2000, 'a') + "\r\n\r\n")
              .rfind("HTTP/1.1 431", 0) == 0);
  // A client that never finishes its request head is disconnected with no answer.
  auto t0 = std::chrono::steady_clock::now();
  REQUIRE(HttpExchange(http.port(), "GET / HTTP/1.1\r\n").empty());
  REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));

  // A head whose lines end in "\n" alone is answered 400 at once, not left to time out.
  REQUIRE(HttpExchange(http.port(), "GET / HTTP/1.1\nHost: x\n\n").rfind("HTTP/1.1 400", 0) == 0);
  asio::io_context other;
  REQUIRE_FALSE(HttpServer(other, nullptr).Listen("not-an-ip", 0).ok());
}

TEST_CASE("a full HTTP server closes the connection that waited longest for its head, so a probe gets in") {
  HttpServer::Limits limits;
  limits.max_connections = 4;
  limits.header_timeout = std::chrono::seconds(60);  // the silent ones stay until they are made room for
  EchoHttp server(limits);
  HttpServer& http = server.http;

  // Four clients connect and send nothing (accepted in order: the listen queue is FIFO).
  asio::io_context here;
  std::vector<tcp::socket> silent;
  for (int i = 0; i < limits.max_connections; ++i) {
    silent.emplace_back(here);
    silent.back().connect({asio::ip::make_address("127.0.0.1"), http.port()});
  }
  // Before, the fifth connection was closed unanswered: a liveness probe failed.
  std::string probe = HttpExchange(http.port(), "GET /healthz HTTP/1.1\r\n\r\n");
  REQUIRE(probe.rfind("HTTP/1.1 200 OK", 0) == 0);
  // The oldest silent client made room: its connection is closed (end of stream, no reply).
  char c;
  boost::system::error_code ec;
  silent.front().read_some(asio::buffer(&c, 1), ec);
  CHECK(ec == asio::error::eof);
  // The newest is still open.
  silent.back().non_blocking(true);
  silent.back().read_some(asio::buffer(&c, 1), ec);
  CHECK(ec == asio::error::would_block);
}
