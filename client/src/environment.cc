// The psrun environment contract (see client.h): PSD_* variables -> ClientOptions.
#include <cerrno>
#include <cstdlib>
#include <string>

#include "psclient/client.h"
#include "psd/cluster_list.h"
#include "psd/secret.h"

namespace psclient {

namespace {

std::optional<std::string> ProcessEnvironment(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

// A whole decimal integer in [lo, hi], or an error naming the variable.
Result<long> ParseInteger(const std::string& name, const std::string& value, long lo, long hi) {
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || end == value.c_str() || *end != '\0' || errno == ERANGE || v < lo || v > hi) {
    return psd::InvalidArgument(name + "='" + value + "' is not a whole number in " + std::to_string(lo) + ".." +
                                std::to_string(hi));
  }
  return v;
}

}  // namespace

Result<LaunchEnvironment> ReadLaunchEnvironment(const EnvironmentLookup& lookup) {
  auto get = [&](const std::string& name) { return lookup ? lookup(name) : ProcessEnvironment(name); };
  LaunchEnvironment env;
  ClientOptions& o = env.options;

  auto cluster = get("PSD_CLUSTER");
  if (!cluster || cluster->empty()) {
    return psd::InvalidArgument(
        "PSD_CLUSTER is not set: run the trainer under psrun, or set PSD_CLUSTER to the shards' host:port list "
        "(e.g. 127.0.0.1:7070)");
  }
  std::vector<std::string> entries = ParseClusterList(*cluster);
  if (entries.empty()) return psd::InvalidArgument("PSD_CLUSTER='" + *cluster + "' lists no host:port");
  const std::string fix = "; PSD_CLUSTER is a comma-separated list of host:port, e.g. 127.0.0.1:7070,127.0.0.1:7071";
  std::vector<psd::HostPort> endpoints;
  for (const auto& e : entries) {
    auto hp = psd::ParseHostPort(e, "PSD_CLUSTER entry");
    if (!hp.ok()) return psd::InvalidArgument(hp.status().message() + fix);
    endpoints.push_back(std::move(*hp));
  }
  if (entries.size() == 1) {
    o.host = endpoints[0].host;
    o.port = endpoints[0].port;
  } else {
    o.cluster = std::move(entries);
  }

  if (auto n = get("PSD_NUM_WORKERS")) {
    auto v = ParseInteger("PSD_NUM_WORKERS", *n, 1, 1 << 20);
    if (!v.ok()) return v.status();
    env.num_workers = static_cast<int>(*v);
  }
  if (auto i = get("PSD_WORKER_INDEX")) {
    long hi = env.num_workers > 0 ? env.num_workers - 1 : (1 << 20);
    auto v = ParseInteger("PSD_WORKER_INDEX", *i, 0, hi);
    if (!v.ok()) {
      if (env.num_workers > 0) {
        return psd::InvalidArgument(v.status().message() + " (PSD_NUM_WORKERS=" + std::to_string(env.num_workers) +
                                    ")");
      }
      return v.status();
    }
    env.worker_index = static_cast<int>(*v);
  }
  if (auto name = get("PSD_WORKER_NAME"); name && !name->empty()) {
    o.worker_name = *name;
  } else if (env.worker_index >= 0) {
    o.worker_name = "worker-" + std::to_string(env.worker_index);
  }
  if (auto chief = get("PSD_CHIEF_ELIGIBLE")) {
    if (*chief != "0" && *chief != "1") {
      return psd::InvalidArgument("PSD_CHIEF_ELIGIBLE='" + *chief + "' must be 1 or 0");
    }
    env.chief_eligible = *chief == "1";
  }
  if (auto token_file = get("PSD_AUTH_TOKEN_FILE"); token_file && !token_file->empty()) {
    auto token = psd::ReadSecretFile(*token_file);
    if (!token.ok()) return psd::InvalidArgument("PSD_AUTH_TOKEN_FILE: " + token.status().message());
    o.auth_token = *token;
  }
  if (auto tls = get("PSD_TLS")) {
    if (*tls != "1" && *tls != "0") return psd::InvalidArgument("PSD_TLS='" + *tls + "' must be 1 or 0");
    o.tls = *tls == "1";
  }
  for (auto [name, out] :
       {std::pair{"PSD_TLS_CA_FILE", &o.tls_ca_file}, std::pair{"PSD_TLS_CERT_FILE", &o.tls_cert_file},
        std::pair{"PSD_TLS_KEY_FILE", &o.tls_key_file}, std::pair{"PSD_TLS_SERVER_NAME", &o.tls_server_name}}) {
    if (auto v = get(name)) *out = *v;
  }
  return env;
}

Result<ClientOptions> ClientOptionsFromEnvironment(const EnvironmentLookup& lookup) {
  auto env = ReadLaunchEnvironment(lookup);
  if (!env.ok()) return env.status();
  return env->options;
}

}  // namespace psclient
