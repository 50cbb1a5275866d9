// The cluster list: every shard's "host:port", the same list on every shard and client
// (psd --cluster/--cluster-file, ClientOptions::cluster, psd_admin --cluster). Parsed and
// validated here only, so psd, libpsclient and psd_admin agree on what a valid list is.
//
// Syntax: entries separated by commas (--cluster) or one per line (--cluster-file, where '#'
// starts a comment and blank lines are skipped). An entry is host:port or [IPv6]:port with a
// port in 1..65535; no entry may appear twice. Thread-safety: pure functions.
#ifndef PSD_CLUSTER_LIST_H_
#define PSD_CLUSTER_LIST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "psd/export.h"
#include "psd/status.h"

namespace psd {

struct HostPort {
  std::string host;  // without brackets for IPv6
  uint16_t port = 0;
};

// Splits "host:port" or "[v6]:port"; InvalidArgument naming `what` (e.g. "--cluster entry") otherwise.
PSD_EXPORT Result<HostPort> ParseHostPort(const std::string& entry, const std::string& what = "cluster entry");

// Splits a comma-separated list (whitespace around entries is ignored, empty items skipped)
// without validating the entries.
PSD_EXPORT std::vector<std::string> SplitClusterList(const std::string& list);

// Every entry is host:port with a port in 1..65535 and appears once. `flag` names the source
// in errors ("--cluster", "--cluster-file /etc/psd/cluster", "ClientOptions::cluster").
PSD_EXPORT Status ValidateClusterList(const std::vector<std::string>& entries, const std::string& flag);

// SplitClusterList + ValidateClusterList.
PSD_EXPORT Result<std::vector<std::string>> ParseClusterList(const std::string& list,
                                                             const std::string& flag = "--cluster");

// Reads a --cluster-file (one entry per line, '#' comments) and validates it.
PSD_EXPORT Result<std::vector<std::string>> ReadClusterFile(const std::string& path);

}  // namespace psd

#endif  // PSD_CLUSTER_LIST_H_
