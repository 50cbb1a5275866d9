// The psrun environment contract: PSD_* variables -> ClientOptions, errors for malformed values,
// and a worker that joins an in-process psd with nothing but the environment.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <map>

#include "support/test_server.h"

using psd::testing::StartServer;
using psd::testing::TestConfig;

namespace {

psclient::EnvironmentLookup Env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

std::string ErrorOf(std::map<std::string, std::string> vars) {
  auto env = psclient::ReadLaunchEnvironment(Env(std::move(vars)));
  REQUIRE(!env.ok());
  CHECK(env.status().code() == psd::Code::kInvalidArgument);
  return env.status().message();
}

// A token file of this test process (removed by the caller).
std::string WriteToken(const std::string& contents) {
  static int n = 0;
  std::string path = "/tmp/psd_environment_test_" + std::to_string(::getpid()) + "_" + std::to_string(n++);
  std::ofstream(path) << contents;
  return path;
}

}  // namespace

TEST_CASE("the launch environment: a cluster, the worker's identity and the token", "[environment]") {
  std::string token_path = WriteToken("s3cret\n");
  auto env = psclient::ReadLaunchEnvironment(Env({{"PSD_CLUSTER", "127.0.0.1:7070,127.0.0.1:7071"},
                                                  {"PSD_WORKER_INDEX", "2"},
                                                  {"PSD_NUM_WORKERS", "4"},
                                                  {"PSD_WORKER_NAME", "worker-2"},
                                                  {"PSD_CHIEF_ELIGIBLE", "0"},
                                                  {"PSD_AUTH_TOKEN_FILE", token_path}}));
  std::remove(token_path.c_str());
  INFO(env.status().ToString());
  REQUIRE(env.ok());
  CHECK(env->options.cluster == std::vector<std::string>{"127.0.0.1:7070", "127.0.0.1:7071"});
  CHECK(env->options.worker_name == "worker-2");
  CHECK(env->options.auth_token == "s3cret");
  CHECK(env->worker_index == 2);
  CHECK(env->num_workers == 4);
  CHECK_FALSE(env->chief_eligible);
}

TEST_CASE("the launch environment: one entry is a single daemon, defaults", "[environment]") {
  auto env = psclient::ReadLaunchEnvironment(
      Env({{"PSD_CLUSTER", "10.1.2.3:7171"}, {"PSD_WORKER_INDEX", "0"}, {"PSD_CHIEF_ELIGIBLE", "1"}}));
  REQUIRE(env.ok());
  CHECK(env->options.cluster.empty());
  CHECK(env->options.host == "10.1.2.3");
  CHECK(env->options.port == 7171);
  CHECK(env->options.worker_name == "worker-0");  // from the index
  CHECK(env->options.auth_token.empty());
  CHECK(env->num_workers == -1);
  CHECK(env->chief_eligible);

  auto only = psclient::ReadLaunchEnvironment(Env({{"PSD_CLUSTER", "[::1]:7070"}}));
  REQUIRE(only.ok());
  CHECK(only->options.host == "::1");
  CHECK(only->options.worker_name.empty());  // the client's default, worker-<pid>
  CHECK(only->worker_index == -1);

  auto opts = psclient::ClientOptionsFromEnvironment(Env({{"PSD_CLUSTER", "h:1,h:2,h:3"}}));
  REQUIRE(opts.ok());
  CHECK(opts->cluster.size() == 3);
}

TEST_CASE("the launch environment: malformed values are refused with what to set", "[environment]") {
  CHECK_THAT(ErrorOf({}), Catch::Contains("PSD_CLUSTER is not set") && Catch::Contains("psrun"));
  CHECK_THAT(ErrorOf({{"PSD_CLUSTER", ""}}), Catch::Contains("PSD_CLUSTER is not set"));
  CHECK_THAT(ErrorOf({{"PSD_CLUSTER", ",,"}}), Catch::Contains("lists no host:port"));
  CHECK_THAT(ErrorOf({{"PSD_CLUSTER", "127.0.0.1"}}), Catch::Contains("'127.0.0.1' is not host:port"));
  CHECK_THAT(ErrorOf({{"PSD_CLUSTER", "h:1,h:99999"}}), Catch::Contains("'h:99999'") && Catch::Contains("1..65535"));
  CHECK_THAT(ErrorOf({{"PSD_CLUSTER", "h:x"}}), Catch::Contains("the port must be a number in 1..65535"));
  CHECK_THAT(ErrorOf({{"PSD_CLUSTER", "h:1"}, {"PSD_WORKER_INDEX", "1x"}}), Catch::Contains("PSD_WORKER_INDEX='1x'"));
  CHECK_THAT(ErrorOf({{"PSD_CLUSTER", "h:1"}, {"PSD_WORKER_INDEX", "4"}, {"PSD_NUM_WORKERS", "4"}}),
             Catch::Contains("PSD_WORKER_INDEX='4'") && Catch::Contains("0..3"));
  CHECK_THAT(ErrorOf({{"PSD_CLUSTER", "h:1"}, {"PSD_NUM_WORKERS", "0"}}), Catch::Contains("PSD_NUM_WORKERS='0'"));
  CHECK_THAT(ErrorOf({{"PSD_CLUSTER", "h:1"}, {"PSD_CHIEF_ELIGIBLE", "yes"}}),
             Catch::Contains("PSD_CHIEF_ELIGIBLE='yes' must be 1 or 0"));
  CHECK_THAT(ErrorOf({{"PSD_CLUSTER", "h:1"}, {"PSD_AUTH_TOKEN_FILE", "/nonexistent/token"}}),
             Catch::Contains("PSD_AUTH_TOKEN_FILE: cannot read the secret file /nonexistent/token"));
}

TEST_CASE("a worker joins an authenticated psd from the environment alone", "[environment]") {
  auto cfg = TestConfig(1);
  cfg.auth_token = "tok";
  auto server = StartServer(cfg);
  std::string token_path = WriteToken("tok\n");
  auto opts =
      psclient::ClientOptionsFromEnvironment(Env({{"PSD_CLUSTER", "127.0.0.1:" + std::to_string(server->port())},
                                                  {"PSD_WORKER_INDEX", "0"},
                                                  {"PSD_NUM_WORKERS", "1"},
                                                  {"PSD_AUTH_TOKEN_FILE", token_path}}));
  std::remove(token_path.c_str());
  REQUIRE(opts.ok());
  opts->connect_timeout_ms = 5000;
  auto c = psclient::Client::Connect(*opts);
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  auto names = (*c)->WorkerDevices();
  REQUIRE(names.ok());
  CHECK(*names == std::vector<std::string>{"worker-0"});
}
