// Test helper: an in-process psd cluster on 127.0.0.1 whose ports are the kernel's. Each shard's
// listening socket is bound on port 0 first (so the whole cluster list is known before any shard
// starts) and handed to its Server (ServerConfig::listen_fd): no port is guessed, none can clash.
#ifndef PSD_TESTS_SUPPORT_TEST_CLUSTER_H_
#define PSD_TESTS_SUPPORT_TEST_CLUSTER_H_

#include <unistd.h>

#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "daemon/server.h"
#include "psclient/client.h"
#include "psd/listen_socket.h"
#include "support/test_server.h"

namespace psd::testing {

struct TestCluster {
  std::vector<std::unique_ptr<server::Server>> shards;
  std::vector<std::string> addresses;  // "127.0.0.1:port" (or "[::1]:port"), shard k's at k
};

// Starts `shards` shards of `cfg` (its cluster, shard_index, host, port and listen_fd are set
// here) listening on `ip` (an IPv6 one is listed as [ip]:port); fails the test case if one does
// not start. A --checkpoint-dir is each shard's own, as on separate hosts: cfg's + "/shard<k>".
inline TestCluster StartTestCluster(server::ServerConfig cfg, int shards, const std::string& ip = "127.0.0.1") {
  TestCluster c;
  std::vector<int> sockets;
  std::vector<SocketAddress> bound(static_cast<size_t>(shards));
  for (int k = 0; k < shards; ++k) {
    auto fd = ListenTcp(ip, 0, &bound[static_cast<size_t>(k)]);
    INFO(fd.status().ToString());
    REQUIRE(fd.ok());
    sockets.push_back(*fd);
    c.addresses.push_back(bound[static_cast<size_t>(k)].ToString());
  }
  cfg.cluster = c.addresses;
  for (int k = 0; k < shards; ++k) {
    server::ServerConfig shard = cfg;
    shard.shard_index = k;
    shard.host = bound[static_cast<size_t>(k)].ip;  // as psd's main() does for its --cluster entry
    shard.port = bound[static_cast<size_t>(k)].port;
    shard.listen_fd = sockets[static_cast<size_t>(k)];  // the Server owns it from Start() on
    if (!cfg.checkpoint_dir.empty()) shard.checkpoint_dir = cfg.checkpoint_dir + "/shard" + std::to_string(k);
    auto s = server::Server::Create(shard);
    if (!s.ok()) ::close(shard.listen_fd);
    INFO(s.status().ToString());
    REQUIRE(s.ok());
    Status started = (*s)->Start();
    INFO(started.ToString());
    REQUIRE(started.ok());
    c.shards.push_back(std::move(*s));
  }
  return c;
}

// A worker of the cluster (every shard listed); fails the test case if it cannot connect.
inline std::unique_ptr<psclient::Client> ConnectCluster(const TestCluster& c, const std::string& name,
                                                        int connect_timeout_ms = 20000) {
  psclient::ClientOptions o;
  o.cluster = c.addresses;
  o.worker_name = name;
  o.connect_timeout_ms = connect_timeout_ms;
  return ConnectWith(o);
}

}  // namespace psd::testing

#endif  // PSD_TESTS_SUPPORT_TEST_CLUSTER_H_
