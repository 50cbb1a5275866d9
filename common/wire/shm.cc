#include "wire/shm.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <vector>

namespace psd::wire {
namespace {

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// recvmsg of at most `n` bytes into `data`; the descriptors that came with them go to *fds (the
// caller owns them; room for 8: any beyond are closed by the kernel and the message is marked
// MSG_CTRUNC in *msg_flags).
ssize_t ReceiveMessage(int sock, void* data, size_t n, int flags, std::vector<int>* fds, int* msg_flags) {
  iovec iov{data, n};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t got;
  do {
    got = ::recvmsg(sock, &msg, flags | MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  if (got < 0) return got;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds->push_back(fd);
    }
  }
  *msg_flags = msg.msg_flags;
  return got;
}

}  // namespace

Result<std::shared_ptr<SharedSegment>> SharedSegment::Create(uint64_t bytes, const std::string& name,
                                                             bool written_here_only) {
  if (bytes < kMinBytes)
    return InvalidArgument("a shared-memory segment needs at least " + std::to_string(kMinBytes) + " bytes");
  int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Unavailable(Errno("memfd_create"));
  // Written here only: the seals are closed after the mapping (F_SEAL_FUTURE_WRITE spares the
  // mappings made before it).
  const int seals = F_SEAL_SHRINK | F_SEAL_GROW | (written_here_only ? 0 : F_SEAL_SEAL);
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0 || ::fcntl(fd, F_ADD_SEALS, seals) != 0) {
    Status s = Unavailable(Errno("sizing and sealing a shared-memory segment"));
    ::close(fd);
    return s;
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    Status s = Unavailable(Errno("mapping a shared-memory segment of " + std::to_string(bytes) + " bytes"));
    ::close(fd);
    return s;
  }
  if (written_here_only && ::fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0) {
    Status s = Unavailable(Errno("sealing a shared-memory segment against other writers (F_SEAL_FUTURE_WRITE)"));
    ::munmap(base, bytes);
    ::close(fd);
    return s;
  }
  return std::shared_ptr<SharedSegment>(new SharedSegment(fd, static_cast<uint8_t*>(base), bytes));
}

Result<std::shared_ptr<SharedSegment>> SharedSegment::Adopt(int fd, uint64_t max_bytes, bool read_only) {
  auto refuse = [fd](const std::string& why) {
    ::close(fd);
    return InvalidArgument("shared-memory segment refused: " + why);
  };
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) return refuse("not a sealable memfd (" + std::string(std::strerror(errno)) + ")");
  if ((seals & F_SEAL_SHRINK) == 0) return refuse("not sealed against shrinking (F_SEAL_SHRINK)");
  if (!read_only && (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) return refuse("sealed against writing");
  struct stat st {};
  if (::fstat(fd, &st) != 0) return refuse(Errno("fstat"));
  if (!S_ISREG(st.st_mode)) return refuse("not a memory file");
  // Plain shared memory only: a hugetlbfs memfd (MFD_HUGETLB) passes the checks above, but its
  // owner can punch its pages out (F_SEAL_SHRINK does not stop that) and let the pool run dry, and
  // psd's next touch of that range would fault (SIGBUS).
  struct statfs fs {};
  if (::fstatfs(fd, &fs) != 0) return refuse(Errno("fstatfs"));
  if (fs.f_type != TMPFS_MAGIC) return refuse("not plain shared memory (a hugetlbfs memfd?)");
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  if (bytes < kMinBytes || bytes > max_bytes) {
    return refuse(std::to_string(bytes) + " bytes, outside [" + std::to_string(kMinBytes) + ", " +
                  std::to_string(max_bytes) + "] (psd --shm-max-bytes)");
  }
  void* base = ::mmap(nullptr, bytes, read_only ? PROT_READ : PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return refuse(Errno("mmap"));
  return std::shared_ptr<SharedSegment>(new SharedSegment(fd, static_cast<uint8_t*>(base), bytes));
}

Result<std::shared_ptr<SharedSegment>> SharedSegment::Adopt(int fd, uint64_t max_bytes) {
  return Adopt(fd, max_bytes, /*read_only=*/false);
}

Result<std::shared_ptr<SharedSegment>> SharedSegment::AdoptReadOnly(int fd, uint64_t max_bytes) {
  return Adopt(fd, max_bytes, /*read_only=*/true);
}

Result<int> SharedSegment::ReadOnlyDescriptor() const {
  // Through /proc: a memfd's own descriptor is always read-write. A memfd is created with mode
  // 0777, so whoever holds a read-only descriptor could open it read-write the same way: its mode
  // becomes 0400 first (this process's descriptor and mapping stay writable). The mode binds
  // neither root nor a process of the same uid (which may change it back): only a segment created
  // `written_here_only` (F_SEAL_FUTURE_WRITE) is safe from them.
  if (::fchmod(fd_, S_IRUSR) != 0) return Unavailable(Errno("making a shared-memory segment read-only (fchmod)"));
  const std::string path = "/proc/self/fd/" + std::to_string(fd_);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Unavailable(Errno("opening " + path + " read-only"));
  return fd;
}

SharedSegment::~SharedSegment() {
  ::munmap(base_, size_);
  ::close(fd_);
}

Status SendWithFds(int sock, const void* data, size_t n, const std::vector<int>& fds) {
  if (fds.empty() || fds.size() > kShmMaxSentFds) {
    return InvalidArgument("one to " + std::to_string(kShmMaxSentFds) + " descriptors per message");
  }
  iovec iov{const_cast<void*>(data), n};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kShmMaxSentFds)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  ssize_t sent;
  do {
    sent = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0) return Unavailable(Errno("sendmsg"));
  if (static_cast<size_t>(sent) != n) return Unavailable("sendmsg sent a part of the message");
  return Status::Ok();
}

Result<std::vector<int>> ReceiveWithFds(int sock, void* data, size_t max_n, size_t* n) {
  // Room for a few descriptors: any that come beyond those expected are closed, not leaked.
  std::vector<int> fds;
  int flags = 0;
  ssize_t got = ReceiveMessage(sock, data, max_n, MSG_DONTWAIT, &fds, &flags);
  if (got < 0) return Unavailable(Errno("recvmsg"));
  const bool truncated = (flags & (MSG_CTRUNC | MSG_TRUNC)) != 0;
  if (fds.empty() || fds.size() > kShmMaxFds || truncated) {
    for (int fd : fds) ::close(fd);
    return InvalidArgument("expected a message with one or two descriptors, got " + std::to_string(got) +
                           " bytes and " + std::to_string(fds.size()) + (truncated ? " (truncated)" : ""));
  }
  *n = static_cast<size_t>(got);
  return fds;
}

ssize_t ReadKeepingFds(int sock, void* data, size_t n, std::vector<int>* passed, size_t keep) {
  std::vector<int> fds;
  int flags = 0;
  ssize_t got = ReceiveMessage(sock, data, n, 0, &fds, &flags);
  if (got < 0) return got;
  for (int fd : fds) {
    if (passed->size() < keep) {
      passed->push_back(fd);
    } else {
      ::close(fd);
    }
  }
  return got;
}

Result<SegmentId> IdentifySegment(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return InvalidArgument(Errno("fstat"));
  return SegmentId{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

std::string ShmAttachMessage(uint64_t connection, std::string_view nonce, bool lane) {
  std::string m(8, '\0');
  for (size_t i = 0; i < 8; ++i) m[i] = static_cast<char>(connection >> (8 * i));
  m.append(nonce);
  if (lane) m += kShmLaneByte;
  return m;
}

uint64_t ShmAttachConnection(const uint8_t* message) {
  uint64_t conn = 0;
  for (int i = 7; i >= 0; --i) conn = (conn << 8) | message[i];
  return conn;
}

std::string AbstractSocketPath(const std::string& name) { return std::string(1, '\0') + name; }

Result<int> ConnectAbstract(const std::string& name) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (name.empty() || name.size() + 1 > sizeof(addr.sun_path)) return InvalidArgument("bad socket name");
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  int sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return Unavailable(Errno("socket"));
  socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  if (::connect(sock, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    Status s = Unavailable(Errno("connect to @" + name));
    ::close(sock);
    return s;
  }
  return sock;
}

}  // namespace psd::wire
