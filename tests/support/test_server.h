// Test helpers: an in-process psd on 127.0.0.1:0 and clients connected to it.
#ifndef PSD_TESTS_SUPPORT_TEST_SERVER_H_
#define PSD_TESTS_SUPPORT_TEST_SERVER_H_

#include <spdlog/spdlog.h>

#include <catch2/catch.hpp>
#include <memory>
#include <string>

#include "daemon/server.h"
#include "psclient/client.h"

namespace psd::testing {

inline server::ServerConfig TestConfig(int replicas, int total = -1, int init_tokens = -1) {
  server::ServerConfig c;
  c.port = 0;
  c.replicas_to_aggregate = replicas;
  c.total_replicas = total;
  c.init_tokens = init_tokens;
  c.summary_interval_s = 0;
  c.default_token_timeout_ms = 10000;
  return c;
}

inline std::unique_ptr<server::Server> StartServer(server::ServerConfig config) {
  auto s = server::Server::Create(std::move(config));
  REQUIRE(s.ok());
  REQUIRE((*s)->Start().ok());
  return std::move(*s);
}

// A worker's options for the daemon on 127.0.0.1:`port`; tests set more fields before ConnectWith.
inline psclient::ClientOptions WorkerOptions(uint16_t port, const std::string& name) {
  psclient::ClientOptions o;
  o.port = port;
  o.worker_name = name;
  o.connect_timeout_ms = 5000;
  return o;
}

// Connects; fails the test case (with the status) if it cannot.
inline std::unique_ptr<psclient::Client> ConnectWith(const psclient::ClientOptions& o) {
  auto c = psclient::Client::Connect(o);
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  return std::move(*c);
}

inline std::unique_ptr<psclient::Client> ConnectWorker(uint16_t port, const std::string& name) {
  return ConnectWith(WorkerOptions(port, name));
}

}  // namespace psd::testing

#endif  // PSD_TESTS_SUPPORT_TEST_SERVER_H_
