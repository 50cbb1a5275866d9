#include "ops/sd_listen.h"

#include <string>

namespace psd::server::ops {
namespace {

// A decimal number in [0, 2^31); -1 when `s` is not one.
long ParseCount(const char* s) {
  long v = 0;
  if (s == nullptr || *s == '\0') return -1;
  for (; *s != '\0'; ++s) {
    if (*s < '0' || *s > '9' || v > (1L << 30)) return -1;
    v = v * 10 + (*s - '0');
  }
  return v;
}

}  // namespace

Result<int> SdListenFd(const char* listen_pid, const char* listen_fds, long self_pid) {
  if (listen_pid == nullptr || listen_fds == nullptr) return -1;
  long pid = ParseCount(listen_pid);
  if (pid < 0) return InvalidArgument("LISTEN_PID '" + std::string(listen_pid) + "' is not a process id");
  if (pid != self_pid) return -1;  // meant for another process (sd_listen_fds ignores them too)
  long n = ParseCount(listen_fds);
  if (n < 0) return InvalidArgument("LISTEN_FDS '" + std::string(listen_fds) + "' is not a number of sockets");
  if (n == 0) return -1;
  if (n > 1) {
    return InvalidArgument("systemd passed " + std::to_string(n) +
                           " sockets (LISTEN_FDS); psd serves one, its data port: give the .socket unit a single "
                           "ListenStream=");
  }
  return kSdListenFdsStart;
}

}  // namespace psd::server::ops
