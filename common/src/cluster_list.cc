#include "psd/cluster_list.h"

#include <fstream>
#include <set>

namespace psd {
namespace {

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

}  // namespace

Result<HostPort> ParseHostPort(const std::string& entry, const std::string& what) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument(what + " '" + entry + "' is not host:port (" + why + ")");
  };
  HostPort hp;
  size_t colon;
  if (!entry.empty() && entry[0] == '[') {
    size_t close = entry.find(']');
    if (close == std::string::npos || close + 1 >= entry.size() || entry[close + 1] != ':') {
      return bad("an IPv6 address is written [addr]:port");
    }
    hp.host = entry.substr(1, close - 1);
    colon = close + 1;
  } else {
    colon = entry.rfind(':');
    if (colon == std::string::npos) return bad("no ':port'");
    hp.host = entry.substr(0, colon);
    if (hp.host.find(':') != std::string::npos) return bad("write an IPv6 address as [addr]:port");
  }
  if (hp.host.empty()) return bad("no host");
  std::string port = entry.substr(colon + 1);
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos) {
    return bad("the port must be a number in 1..65535");
  }
  unsigned long p = std::stoul(port);
  if (p < 1 || p > 65535) return bad("the port must be a number in 1..65535");
  hp.port = static_cast<uint16_t>(p);
  return hp;
}

std::vector<std::string> SplitClusterList(const std::string& list) {
  std::vector<std::string> out;
  for (size_t pos = 0; pos <= list.size();) {
    size_t comma = list.find(',', pos);
    if (comma == std::string::npos) comma = list.size();
    std::string item = Trim(list.substr(pos, comma - pos));
    if (!item.empty()) out.push_back(item);
    pos = comma + 1;
  }
  return out;
}

Status ValidateClusterList(const std::vector<std::string>& entries, const std::string& flag) {
  std::set<std::string> seen;
  for (size_t i = 0; i < entries.size(); ++i) {
    auto hp = ParseHostPort(entries[i], flag + " entry " + std::to_string(i));
    if (!hp.ok()) return hp.status();
    if (!seen.insert(hp->host + "\n" + std::to_string(hp->port)).second) {
      return InvalidArgument(flag + " lists '" + entries[i] +
                             "' twice: every shard needs its own host:port (one entry per shard)");
    }
  }
  return Status::Ok();
}

Result<std::vector<std::string>> ParseClusterList(const std::string& list, const std::string& flag) {
  std::vector<std::string> out = SplitClusterList(list);
  if (out.empty()) return InvalidArgument(flag + " is empty: list every shard's host:port, comma-separated");
  PSD_RETURN_IF_ERROR(ValidateClusterList(out, flag));
  return out;
}

Result<std::vector<std::string>> ReadClusterFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return InvalidArgument("cannot read --cluster-file " + path);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(f, line)) {
    auto hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    line = Trim(line);
    if (!line.empty()) out.push_back(line);
  }
  if (out.empty()) return InvalidArgument("--cluster-file " + path + " lists no shard (one host:port per line)");
  PSD_RETURN_IF_ERROR(ValidateClusterList(out, "--cluster-file " + path));
  return out;
}

}  // namespace psd
