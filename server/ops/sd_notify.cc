#include "ops/sd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace psd::server::ops {

Status SdNotify(const std::string& socket_path, const std::string& state) {
  if (socket_path.empty()) return Status::Ok();
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path) || (socket_path[0] != '/' && socket_path[0] != '@')) {
    return InvalidArgument("NOTIFY_SOCKET '" + socket_path + "' is not a socket path");
  }
  std::memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  if (addr.sun_path[0] == '@') addr.sun_path[0] = '\0';  // abstract namespace
  socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + socket_path.size());
  int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Unavailable(std::string("sd_notify: socket: ") + std::strerror(errno));
  ssize_t n = ::sendto(fd, state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&addr), len);
  int err = errno;
  ::close(fd);
  if (n < 0) return Unavailable("sd_notify to " + socket_path + ": " + std::strerror(err));
  return Status::Ok();
}

}  // namespace psd::server::ops
