// Shared memory between a worker and a daemon on one host (README "Same-host shared memory").
//
// A worker creates a SharedSegment (a memfd, sealed so it can never shrink or grow, mapped
// MAP_SHARED) and passes its descriptor to the daemon over a Unix socket (SendWithFd); the daemon
// maps it too (SharedSegment::Adopt). Gradients are then written into the segment and pushes
// carry only where they are (Tensor.inShm/shmOffset/shmBytes); pull replies are written into it.
//
// Trust: the daemon treats the pages as untrusted bytes that may change at any moment. Every
// (offset, bytes) is bounds-checked against the size fixed at Adopt, and the shrink seal means a
// page inside that size can never vanish under the mapping (which would be SIGBUS). A worker that
// dies or scribbles mid-push can only spoil its own gradient's values, as a garbage push over TCP
// could.
#ifndef PSD_WIRE_SHM_H_
#define PSD_WIRE_SHM_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "psd/status.h"

namespace psd::wire {

// Tensors in a segment start at multiples of 64 bytes (a pull's values are written so into its
// ShmTarget): the room `bytes` takes there, and the first offset at or after `offset`.
constexpr uint64_t ShmAlign(uint64_t offset) { return (offset + 63) & ~uint64_t{63}; }

// Tensor.shmSegment of a value named where the daemon keeps it: its values segment, which workers
// map read-only (server/service/values_segment.h). Segment 0 is the connection's own, 1 the
// worker's shared buffers.
inline constexpr uint8_t kValuesSegment = 2;

// What a worker sends on psd's shared-memory socket with its segment's descriptor: the
// connection id (8 bytes, little-endian) and the hello's one-time nonce.
inline constexpr size_t kShmNonceBytes = 32;
inline constexpr size_t kShmAttachBytes = 8 + kShmNonceBytes;
// The same and one more byte (kShmLaneByte) asks for a request lane too (wire/shm_lane.h): the
// answer is then "OK", kShmAnswerValues when the values segment's descriptor comes with it, and
// kShmAnswerLane when the lane's (ShmLane::kFds, after it) do.
inline constexpr size_t kShmAttachLaneBytes = kShmAttachBytes + 1;
inline constexpr char kShmLaneByte = 'L';
inline constexpr char kShmAnswerValues[] = " values";
inline constexpr char kShmAnswerLane[] = " lane";
std::string ShmAttachMessage(uint64_t connection, std::string_view nonce, bool lane = false);
// The connection id of such a message (the nonce is its last kShmNonceBytes bytes).
uint64_t ShmAttachConnection(const uint8_t* message);
// With the attach message, a worker sends its segment's descriptor and, when it has shared
// buffers (psclient::Client::AllocateShared), their arena's second: segment 1 of its tensors
// (Tensor.shmSegment). Only the holder of an arena's descriptor can send it, so this message with
// the arena's descriptor (and no other) revokes every mapping of that arena the daemon holds for
// an earlier connection: the daemon reads and writes it no more (a worker whose connection broke
// sends it before it reuses its buffers).
inline constexpr char kShmRevokeMessage[] = "psd-shm-revoke";
inline constexpr size_t kShmRevokeBytes = sizeof(kShmRevokeMessage) - 1;
static_assert(kShmRevokeBytes != kShmAttachBytes, "the two messages differ in size");

class SharedSegment {
 public:
  // A new segment of `bytes` (pages are allocated only when touched): memfd, sealed against
  // shrinking and growing, mapped read-write. `written_here_only`: also sealed F_SEAL_FUTURE_WRITE
  // once mapped here — this mapping stays the only writable one: no descriptor of it, however
  // opened (a same-uid process can change its mode), maps it writable or writes it, root's neither;
  // the price is that its pages cannot be punched out (fallocate) either.
  static Result<std::shared_ptr<SharedSegment>> Create(uint64_t bytes, const std::string& name,
                                                       bool written_here_only = false);
  // Maps a segment another process created; takes `fd` (closed on failure too). Refused unless it
  // is sealed against shrinking and its size is within [kMinBytes, max_bytes].
  static Result<std::shared_ptr<SharedSegment>> Adopt(int fd, uint64_t max_bytes);
  // Adopt's twin for a segment this process may only read (the daemon's values segment, in a
  // worker): mapped PROT_READ; a segment sealed against writing is fine here.
  static Result<std::shared_ptr<SharedSegment>> AdoptReadOnly(int fd, uint64_t max_bytes);

  static constexpr uint64_t kMinBytes = 4096;

  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  uint8_t* data() const { return base_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  // A new descriptor of this segment opened read-only (the caller owns it): what another process is
  // given that may read the pages but never map them writable.
  Result<int> ReadOnlyDescriptor() const;
  // [offset, offset + bytes) inside the segment, or nullptr.
  uint8_t* At(uint64_t offset, uint64_t bytes) const {
    if (offset > size_ || bytes > size_ - offset) return nullptr;
    return base_ + offset;
  }

 private:
  SharedSegment(int fd, uint8_t* base, uint64_t size) : fd_(fd), base_(base), size_(size) {}
  // Adopt and AdoptReadOnly.
  static Result<std::shared_ptr<SharedSegment>> Adopt(int fd, uint64_t max_bytes, bool read_only);
  int fd_;
  uint8_t* base_;
  uint64_t size_;
};

// Sends `n` bytes and up to kShmMaxSentFds descriptors in one message on a connected Unix stream
// socket (an attach carries one or two, kShmMaxFds; its answer up to five).
inline constexpr size_t kShmMaxFds = 2;
inline constexpr size_t kShmMaxSentFds = 8;
Status SendWithFds(int sock, const void* data, size_t n, const std::vector<int>& fds);
// Receives one message of at most `max_n` bytes (its size in *n) carrying one or two descriptors
// (returned; the caller owns them). Anything else (no descriptor, more than two, truncated) is
// INVALID_ARGUMENT, and every descriptor that came with it is closed. The socket must be readable
// (non-blocking read).
Result<std::vector<int>> ReceiveWithFds(int sock, void* data, size_t max_n, size_t* n);
// read() on a Unix socket that keeps the descriptors sent with the bytes: they are appended to
// *passed while it holds fewer than `keep` (the caller owns them), any other is closed. Blocks as
// read() does.
ssize_t ReadKeepingFds(int sock, void* data, size_t n, std::vector<int>* passed, size_t keep);

// Which memory a descriptor maps (st_dev, st_ino): the same memfd sent twice is recognised.
struct SegmentId {
  uint64_t dev = 0;
  uint64_t ino = 0;
  bool operator<(const SegmentId& o) const { return dev != o.dev ? dev < o.dev : ino < o.ino; }
  bool operator==(const SegmentId& o) const { return dev == o.dev && ino == o.ino; }
};
Result<SegmentId> IdentifySegment(int fd);

// Abstract Unix socket names (Linux: no file; reachable only from the same network namespace,
// i.e. from this host or pod). The path an Asio local endpoint takes for `name`:
std::string AbstractSocketPath(const std::string& name);
// A connected, blocking Unix stream socket to `name` (the caller closes it), or why not.
Result<int> ConnectAbstract(const std::string& name);

}  // namespace psd::wire

#endif  // PSD_WIRE_SHM_H_
