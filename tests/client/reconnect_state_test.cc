// What a reconnect rewrites (the handshake's job settings, the connection count) is read safely by
// Client::config() / connection_epoch() from other threads (issue 11 item 8).
#include <atomic>
#include <catch2/catch.hpp>
#include <thread>
#include <vector>

#include "psclient/client.h"
#include "support/test_server.h"

namespace {

// A client whose replies may be at most 64 KiB and that asks for values whole (pull_frame_bytes 0:
// one reply, no ranges), and a 1 MiB variable: pulling it breaks the connection ("the stream is
// out of step"), so the next call reconnects and says hello again.
struct Reconnector {
  explicit Reconnector(uint16_t port) {
    psclient::ClientOptions o;
    o.port = port;
    o.worker_name = "w0";
    o.connect_timeout_ms = 5000;
    o.max_frame_bytes = 64 << 10;
    o.pull_frame_bytes = 0;
    o.shared_memory_bytes = 0;  // the stream is broken by a reply over max_frame_bytes: TCP only
    auto c = psclient::Client::Connect(o);
    REQUIRE(c.ok());
    client = std::move(*c);
    REQUIRE(client->CreateVariable("big", {nullptr, psd::DType::kFloat32, {kRows}}).ok());
  }
  void Reconnect() {
    REQUIRE(client->Pull("big", {buffer.data(), psd::DType::kFloat32, {kRows}}).status().code() ==
            psd::Code::kResourceExhausted);
    REQUIRE(client->GetStatus().ok());  // reconnects
  }
  static constexpr int64_t kRows = 256 << 10;
  std::unique_ptr<psclient::Client> client;
  std::vector<float> buffer = std::vector<float>(kRows);
};

psd::server::ServerConfig MomentumConfig() {
  auto cfg = psd::testing::TestConfig(1);
  cfg.optimizer.name = "momentum";
  return cfg;
}

}  // namespace

TEST_CASE("config() is a snapshot: a reconnect does not rewrite what the caller holds", "[client][races]") {
  auto server = psd::testing::StartServer(MomentumConfig());
  Reconnector r(server->port());
  const psclient::JobConfig& held = r.client->config();  // a reference used to alias the live field
  const double lr = held.learning_rate;
  const uint64_t epoch = r.client->connection_epoch();
  REQUIRE(r.client->SetLearningRate(lr * 2).ok());
  r.Reconnect();  // the new hello announces the new learning rate
  CHECK(held.learning_rate == lr);
  CHECK(r.client->config().learning_rate == lr * 2);
  CHECK(r.client->connection_epoch() == epoch + 1);
}

TEST_CASE("config(), worker_id() and connection_epoch() are safe during reconnects on another thread",
          "[client][races]") {
  // Meant for the sanitizer builds: without the lock a reader copies a JobConfig while the hello
  // reassigns its strings.
  auto server = psd::testing::StartServer(MomentumConfig());
  Reconnector r(server->port());
  std::atomic<bool> stop{false};
  uint64_t last_epoch = 0;
  bool monotonic = true;
  std::thread reader([&] {
    while (!stop.load()) {
      psclient::JobConfig c = r.client->config();
      (void)r.client->worker_id();
      (void)r.client->SlotNames();
      uint64_t e = r.client->connection_epoch();
      monotonic = monotonic && e >= last_epoch && c.optimizer == "momentum";
      last_epoch = e;
    }
  });
  const uint64_t first = r.client->connection_epoch();
  for (int i = 0; i < 20; ++i) r.Reconnect();
  stop = true;
  reader.join();
  CHECK(monotonic);
  CHECK(r.client->connection_epoch() == first + 20);
}
