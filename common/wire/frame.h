// Framing of psd messages on a byte stream: Cap'n Proto's standard stream format (segment table
// then segments), with every size checked against a limit before anything is allocated.
// Shared by the daemon (async reads) and the client (blocking reads). Not a public header.
#ifndef PSD_WIRE_FRAME_H_
#define PSD_WIRE_FRAME_H_

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/array.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "psd.capnp.h"
#include "psd/status.h"
#include "psd/tensor.h"
#include "wire/asio.h"

namespace psd::wire {

// Each zero-copy tensor is its own segment, so a reply with many variables has many segments;
// the table costs 4 bytes per segment and is bounded here before anything else is read.
constexpr uint32_t kMaxSegments = 1u << 16;
// Tensors smaller than this are copied into the message instead of referenced: a segment of its
// own costs more than the copy (the builder's and the reader's allocations for it, a table entry,
// a buffer more in the write; at 4 KiB, 4 more allocations a message on each side). 8 KiB: up to
// there the copy mostly fits the message's first segment (8 KiB); a bigger one would take a
// segment of its own all the same, and referenced, a pulled value lands in the caller's memory.
constexpr size_t kZeroCopyMinBytes = 8192;
constexpr uint64_t kDefaultMaxFrameBytes = 1ull << 30;  // 1 GiB

// Parses the first word of a frame. On success sets the segment count and the number of
// further header bytes to read (the rest of the segment table, padded to a word).
Status ParseFirstWord(const uint32_t first[2], uint32_t* segment_count, size_t* rest_header_bytes);

// Given the whole segment table (segment_count sizes in words), checks the total against
// max_frame_bytes and returns the per-segment word counts and the total. A bigger frame is
// RESOURCE_EXHAUSTED naming `limit_name`, the setting to raise.
Status ParseSegmentSizes(const uint32_t* table, uint32_t segment_count, uint64_t max_frame_bytes,
                         std::vector<uint32_t>* sizes, uint64_t* total_words,
                         const std::string& limit_name = "psd's --max-frame-bytes");

// An incoming frame: the body lives in a word-aligned buffer that the FrameReader reuses.
// Where a frame's second and last segment may be read instead of the body buffer: a ranged pull
// reply carries one tensor, which the daemon references as its own segment, so the client reads
// those bytes straight into the caller's view (and checks, once the reply is parsed, that the
// tensor's data is what landed there).
struct Landing {
  void* dst = nullptr;  // 8-byte aligned
  size_t bytes = 0;     // a multiple of 8: the segment must be exactly this long to land
};

// Where an InFrame's body buffer comes from when it needs a bigger one: the heap by default; the
// daemon keeps big frames' buffers in a pool bounded by --max-inflight-bytes
// (server/net/frame_pool.h). Disposing the array hands the buffer back to its source.
class BufferSource {
 public:
  virtual ~BufferSource() = default;
  // A buffer of at least `words` words (its size() may be more).
  virtual kj::Array<capnp::word> Take(uint64_t words) = 0;
};

class InFrame {
 public:
  // `source` (may be null: the heap) outlives the frame.
  explicit InFrame(BufferSource* source = nullptr) : source_(source) {}
  // Resizes the body buffer for total_words (never shrinks below what it has unless asked).
  capnp::word* Prepare(const std::vector<uint32_t>& sizes, uint64_t total_words);
  // For a two-segment frame whose second segment lands at `landing.dst`: the buffer holds only
  // the first. Returns it.
  capnp::word* PrepareLanded(const std::vector<uint32_t>& sizes, const Landing& landing);
  // Builds a reader over the body; limits guard against pointer amplification.
  std::unique_ptr<capnp::MessageReader> Reader() const;
  // Gives memory back when the buffer is much bigger than the frames it has recently held, so a
  // one-off big frame does not pin memory, while steady big pushes reuse one buffer.
  void MaybeRelease(size_t keep_bytes);
  size_t body_bytes() const { return total_words_ * sizeof(capnp::word); }
  // The memory the buffer holds (what Prepare allocated and has not given back).
  size_t capacity_bytes() const { return buffer_.size() * sizeof(capnp::word); }
  // Gives the buffer's memory back now.
  void Release() { buffer_ = nullptr; }

 private:
  BufferSource* source_;
  kj::Array<capnp::word> buffer_;
  const capnp::word* landed_ = nullptr;  // the last segment, when it was read elsewhere
  std::vector<uint32_t> sizes_;
  uint64_t total_words_ = 0;
  uint64_t recent_max_words_ = 0;  // largest frame since the last release check
  int frames_since_check_ = 0;
};

// An outgoing frame: the message builder plus the segment table, kept alive together until
// the write completes. External data referenced by the message is kept alive by `keepalive`.
struct OutFrame {
  capnp::MallocMessageBuilder builder;
  std::vector<uint32_t> table;
  std::vector<std::shared_ptr<const void>> keepalive;

  // Finalizes the table and returns the scatter-gather buffers (table + segments).
  std::vector<asio::const_buffer> Buffers();
  // The bytes of the message's segments: what the receiver compares with its --max-frame-bytes.
  uint64_t BodyBytes();
};

// Blocking helpers (client side and tests), bounded by `deadline` (DeadlineExceeded past it; the
// stream is then out of step and the caller must drop the connection). They switch the socket to
// non-blocking mode and wait with poll(), so no single read or write can outlive the deadline.
using Deadline = std::chrono::steady_clock::time_point;
constexpr Deadline kNoDeadline = Deadline::max();

// A connection's read-ahead (the client's ReadFrame, the daemon's net::Connection): what a read
// brought beyond the bytes asked for (the rest of a small frame, the start of the next one), so a
// small frame costs one read instead of three (header, segment table, body). A rest bigger than
// half of it is read in place. Belongs to one connection: Clear() it when that is dropped.
class ReadAhead {
 public:
  explicit ReadAhead(size_t bytes = 64 << 10) : bytes_(bytes) {}
  size_t capacity() const { return bytes_; }
  size_t held() const { return end_ - begin_; }
  void Clear() { begin_ = end_ = 0; }
  // Copies up to n held bytes to dst; returns how many.
  size_t Take(void* dst, size_t n);
  // Whether n bytes still to read are few enough to go through the read-ahead.
  bool Small(size_t n) const { return n < bytes_ / 2; }
  // Where a read may put bytes (RoomBytes() of them; allocated at the first call), and how many it did.
  uint8_t* Room();
  size_t RoomBytes() const { return bytes_ - end_; }
  void Filled(size_t n) { end_ += n; }

 private:
  const size_t bytes_;
  std::unique_ptr<uint8_t[]> buf_;
  size_t begin_ = 0;
  size_t end_ = 0;
};

Status WriteFrame(tcp::socket& socket, OutFrame& frame, Deadline deadline = kNoDeadline);
// Reads one frame into `in`; max_frame_bytes (named `limit_name` in errors) bounds the allocation.
// With `landing`, a frame of two segments whose second is exactly landing->bytes long has that
// segment read into landing->dst. `busy_poll_us` > 0: a read that finds nothing keeps trying for
// that long before it sleeps in poll(). With `ahead`, reads go through that read-ahead (the same
// one for every frame of the connection).
Status ReadFrame(tcp::socket& socket, InFrame& in, uint64_t max_frame_bytes, Deadline deadline = kNoDeadline,
                 const std::string& limit_name = "psd's --max-frame-bytes", const Landing* landing = nullptr,
                 int64_t busy_poll_us = 0, ReadAhead* ahead = nullptr);

// Reads one frame with `read_exactly` (n bytes or an error): the framing shared by the socket and
// the TLS versions.
Status ReadFrameWith(const std::function<Status(void*, size_t)>& read_exactly, InFrame& in, uint64_t max_frame_bytes,
                     const std::string& limit_name, const Landing* landing = nullptr);

// Enum conversions between the wire and psd types.
Code FromWire(proto::Code code);
proto::Code ToWire(Code code);
Result<DType> FromWire(proto::DType dtype);
proto::DType ToWire(DType dtype);

// A validated view of a wire tensor: dtype known, shape sane, data size exact. A tensor said to
// be in shared memory (Tensor.inShm) is INVALID_ARGUMENT unless `in_shm_ok` (then `data` is
// empty: the caller finds the bytes in its segment).
struct TensorRef {
  DType dtype;
  Shape shape;
  const uint8_t* data;
  size_t bytes;
};
Result<TensorRef> ReadTensor(proto::Tensor::Reader t, uint64_t max_bytes, bool in_shm_ok = false);

// Fills a wire tensor. The data is referenced without copying when it is word-aligned and
// either a whole number of words or `padded` (the owner guarantees zeroed bytes up to the next
// word); the caller then keeps it valid and unchanged until the frame is written. Otherwise
// the bytes are copied into the message.
void SetTensor(capnp::MessageBuilder& msg, proto::Tensor::Builder t, DType dtype, const Shape& shape, const void* data,
               size_t bytes, bool padded = false);

// Says in `t` that a tensor of `dtype` and `shape` is at `offset` of shared-memory segment
// `segment` (Tensor.inShm; wire/shm.h names the segments), its bytes not in the frame.
void NameInShm(proto::Tensor::Builder t, DType dtype, const Shape& shape, unsigned segment, uint64_t offset);

}  // namespace psd::wire

#endif  // PSD_WIRE_FRAME_H_
