#include "bench_util.h"

#include <sys/resource.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>

#include "psd/cluster_list.h"

namespace psd_bench {

// CPU seconds (user + system) this process has used so far: the workers' cost, and the daemon's
// too when it runs in-process (busy-poll's price shows here).
double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto secs = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6; };
  return secs(u.ru_utime) + secs(u.ru_stime);
}

Result<uint64_t> ParseBytes(const std::string& text) {
  size_t i = 0;
  uint64_t value = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    uint64_t digit = static_cast<uint64_t>(text[i] - '0');
    if (value > (UINT64_MAX - digit) / 10) return psd::InvalidArgument("'" + text + "' is too large");
    value = value * 10 + digit;
    ++i;
  }
  if (i == 0) return psd::InvalidArgument("'" + text + "' is not a size (examples: 4096, 4K, 4M, 64M)");
  std::string suffix = text.substr(i);
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  uint64_t multiplier = 1;
  if (suffix == "K" || suffix == "KB" || suffix == "KIB") {
    multiplier = 1ull << 10;
  } else if (suffix == "M" || suffix == "MB" || suffix == "MIB") {
    multiplier = 1ull << 20;
  } else if (suffix == "G" || suffix == "GB" || suffix == "GIB") {
    multiplier = 1ull << 30;
  } else if (!suffix.empty() && suffix != "B") {
    return psd::InvalidArgument("'" + text + "' has an unknown suffix (use K, M or G)");
  }
  if (value > UINT64_MAX / multiplier) return psd::InvalidArgument("'" + text + "' is too large");
  return value * multiplier;
}

Result<Endpoint> ParseEndpoint(const std::string& text) {
  Endpoint ep;
  if (text.find(',') != std::string::npos) {
    // A cluster: every shard's address, in shard order (the client's ClientOptions::cluster).
    auto list = psd::ParseClusterList(text, "--connect");
    if (!list.ok()) return list.status();
    ep.cluster = std::move(*list);
  }
  auto hp = psd::ParseHostPort(ep.cluster.empty() ? text : ep.cluster.front(), "--connect");
  if (!hp.ok()) return hp.status();
  ep.host = hp->host;
  ep.port = hp->port;
  return ep;
}

// Splits the model into float32 variables whose sizes differ by at most one element.
Result<std::vector<VarSpec>> MakeVariables(uint64_t model_bytes, int count) {
  if (model_bytes % sizeof(float) != 0) {
    return psd::InvalidArgument("--model-bytes must be a multiple of 4 (float32 variables), got " +
                                std::to_string(model_bytes));
  }
  uint64_t elements = model_bytes / sizeof(float);
  if (count < 1 || elements < static_cast<uint64_t>(count)) {
    return psd::InvalidArgument("--variables must be in [1, " + std::to_string(elements) + "] for --model-bytes " +
                                std::to_string(model_bytes));
  }
  uint64_t base = elements / static_cast<uint64_t>(count);
  uint64_t extra = elements % static_cast<uint64_t>(count);
  std::vector<VarSpec> vars;
  vars.reserve(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    uint64_t n = base + (static_cast<uint64_t>(i) < extra ? 1 : 0);
    if (n * sizeof(float) > kMaxVariableBytes) {
      return psd::InvalidArgument("a variable of " + std::to_string(n * sizeof(float)) +
                                  " bytes exceeds the wire limit of 512 MiB per tensor; raise --variables");
    }
    vars.push_back({"bench/v" + std::to_string(i), static_cast<int64_t>(n)});
  }
  return vars;
}

// Nearest-rank percentile of `v` (sorted in place); 0 for no samples.
double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  auto rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// JSON has no NaN or infinity; a figure that could not be measured is null.
std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

// --tls-dir: the workers speak TLS and verify psd against DIR/ca.pem.
void ApplyTls(const Options& opt, psclient::ClientOptions& co) {
  if (opt.tls_dir.empty()) return;
  co.tls_ca_file = opt.tls_dir + "/ca.pem";
}

}  // namespace psd_bench
