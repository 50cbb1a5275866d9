#include "wire/frame.h"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace psd::wire {

Status ParseFirstWord(const uint32_t first[2], uint32_t* segment_count, size_t* rest_header_bytes) {
  uint64_t count = static_cast<uint64_t>(first[0]) + 1;
  if (count > kMaxSegments) {
    return ResourceExhausted("frame has " + std::to_string(count) + " segments (limit " + std::to_string(kMaxSegments) +
                             ")");
  }
  *segment_count = static_cast<uint32_t>(count);
  size_t header_bytes = ((1 + count) * 4 + 7) / 8 * 8;
  *rest_header_bytes = header_bytes - 8;
  return Status::Ok();
}

Status ParseSegmentSizes(const uint32_t* table, uint32_t segment_count, uint64_t max_frame_bytes,
                         std::vector<uint32_t>* sizes, uint64_t* total_words, const std::string& limit_name) {
  sizes->assign(table, table + segment_count);
  uint64_t total = 0;
  for (uint32_t s : *sizes) total += s;
  if (total == 0) return InvalidArgument("empty frame");
  if (total * sizeof(capnp::word) > max_frame_bytes) {
    return ResourceExhausted("a message of " + std::to_string(total * sizeof(capnp::word)) + " bytes is over " +
                             limit_name + " (" + std::to_string(max_frame_bytes) +
                             " bytes): raise it (on every shard), or move fewer or smaller variables per call");
  }
  *total_words = total;
  return Status::Ok();
}

capnp::word* InFrame::Prepare(const std::vector<uint32_t>& sizes, uint64_t total_words) {
  if (buffer_.size() < total_words) {
    buffer_ = nullptr;  // given back first, so the source may hand it out again
    buffer_ = source_ != nullptr ? source_->Take(total_words) : kj::heapArray<capnp::word>(total_words);
  }
  sizes_ = sizes;
  total_words_ = total_words;
  landed_ = nullptr;
  return buffer_.begin();
}

capnp::word* InFrame::PrepareLanded(const std::vector<uint32_t>& sizes, const Landing& landing) {
  capnp::word* first = Prepare({sizes[0]}, sizes[0]);
  sizes_ = sizes;
  total_words_ = static_cast<uint64_t>(sizes[0]) + sizes[1];
  landed_ = static_cast<const capnp::word*>(landing.dst);
  return first;
}

std::unique_ptr<capnp::MessageReader> InFrame::Reader() const {
  // SegmentArrayMessageReader keeps a pointer to the array of segment pointers only during
  // construction (it copies them), so a local vector is fine.
  std::vector<kj::ArrayPtr<const capnp::word>> segs;
  segs.reserve(sizes_.size());
  const capnp::word* p = buffer_.begin();
  for (size_t i = 0; i < sizes_.size(); ++i) {
    if (landed_ != nullptr && i + 1 == sizes_.size()) {
      segs.emplace_back(landed_, sizes_[i]);
      break;
    }
    segs.emplace_back(p, sizes_[i]);
    p += sizes_[i];
  }
  capnp::ReaderOptions options;
  // Each word may be visited once plus a margin for list headers; blocks amplification attacks.
  options.traversalLimitInWords = total_words_ * 2 + 1024;
  options.nestingLimit = 16;
  struct OwningReader : capnp::SegmentArrayMessageReader {
    OwningReader(std::vector<kj::ArrayPtr<const capnp::word>> s, capnp::ReaderOptions o)
        : capnp::SegmentArrayMessageReader(kj::ArrayPtr<const kj::ArrayPtr<const capnp::word>>(s.data(), s.size()), o),
          segs(std::move(s)) {}
    std::vector<kj::ArrayPtr<const capnp::word>> segs;
  };
  return std::make_unique<OwningReader>(std::move(segs), options);
}

void InFrame::MaybeRelease(size_t keep_bytes) {
  recent_max_words_ = std::max(recent_max_words_, total_words_);
  if (++frames_since_check_ < 64) return;
  // Every 64 frames: drop the buffer if it is over keep_bytes and over twice what they needed.
  if (buffer_.size() * sizeof(capnp::word) > keep_bytes && buffer_.size() > 2 * recent_max_words_) {
    buffer_ = nullptr;
  }
  recent_max_words_ = 0;
  frames_since_check_ = 0;
}

std::vector<asio::const_buffer> OutFrame::Buffers() {
  auto segs = builder.getSegmentsForOutput();
  table.clear();
  table.reserve(segs.size() + 2);  // one allocation, not one per doubling
  table.push_back(static_cast<uint32_t>(segs.size() - 1));
  for (auto& s : segs) table.push_back(static_cast<uint32_t>(s.size()));
  if (table.size() % 2) table.push_back(0);
  std::vector<asio::const_buffer> out;
  out.reserve(segs.size() + 1);
  out.emplace_back(table.data(), table.size() * sizeof(uint32_t));
  for (auto& s : segs) out.emplace_back(s.begin(), s.size() * sizeof(capnp::word));
  return out;
}

uint64_t OutFrame::BodyBytes() {
  uint64_t words = 0;
  for (auto& s : builder.getSegmentsForOutput()) words += s.size();
  return words * sizeof(capnp::word);
}

namespace {

// Waits until the socket can be read (POLLIN) or written (POLLOUT), or the deadline passes.
Status WaitReady(tcp::socket& socket, short events, Deadline deadline) {
  for (;;) {
    int timeout_ms = -1;
    if (deadline != kNoDeadline) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return DeadlineExceeded("no answer from psd before the deadline");
      timeout_ms = static_cast<int>(std::min<int64_t>(left.count() + 1, 1 << 30));
    }
    pollfd p{socket.native_handle(), events, 0};
    int r = ::poll(&p, 1, timeout_ms);
    if (r > 0) return Status::Ok();
    if (r < 0 && errno != EINTR) return Unavailable(std::string("poll: ") + std::strerror(errno));
  }
}

// `busy_poll_us` > 0: when nothing is there yet, keep trying for up to that long before sleeping
// in poll() (lower latency for small replies, a core kept busy meanwhile).
// With `ahead`: what it holds first, then small rests through it (one read may bring the rest of
// the frame and the next one's start), big ones in place.
Status ReadExactly(tcp::socket& socket, void* data, size_t n, Deadline deadline, int64_t busy_poll_us,
                   ReadAhead* ahead) {
  auto* p = static_cast<uint8_t*>(data);
  if (ahead != nullptr) {
    size_t got = ahead->Take(p, n);
    p += got;
    n -= got;
  }
  std::chrono::steady_clock::time_point spin_until{};
  bool spinning = false;
  while (n > 0) {
    boost::system::error_code ec;
    const bool via_ahead = ahead != nullptr && ahead->Small(n);
    size_t k = via_ahead ? socket.read_some(asio::buffer(ahead->Room(), ahead->RoomBytes()), ec)
                         : socket.read_some(asio::buffer(p, n), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      if (busy_poll_us > 0) {
        auto now = std::chrono::steady_clock::now();
        if (!spinning) {
          spinning = true;
          spin_until = now + std::chrono::microseconds(busy_poll_us);
        }
        if (now < spin_until && now < deadline) continue;
      }
      PSD_RETURN_IF_ERROR(WaitReady(socket, POLLIN, deadline));
      continue;
    }
    if (ec) return Unavailable("connection lost: " + ec.message());
    spinning = false;
    if (via_ahead) {
      ahead->Filled(k);
      k = ahead->Take(p, n);
    }
    p += k;
    n -= k;
  }
  return Status::Ok();
}

void MakeNonBlocking(tcp::socket& socket) {
  boost::system::error_code ec;
  if (!socket.non_blocking()) socket.non_blocking(true, ec);
}

}  // namespace

Status WriteFrame(tcp::socket& socket, OutFrame& frame, Deadline deadline) {
  MakeNonBlocking(socket);
  std::vector<asio::const_buffer> left = frame.Buffers();
  size_t first = 0;  // index of the first buffer with bytes left
  while (first < left.size()) {
    boost::system::error_code ec;
    size_t k = socket.write_some(std::vector<asio::const_buffer>(left.begin() + first, left.end()), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      PSD_RETURN_IF_ERROR(WaitReady(socket, POLLOUT, deadline));
      continue;
    }
    if (ec) return Unavailable("write failed: " + ec.message());
    while (k > 0 && first < left.size()) {
      size_t take = std::min(k, left[first].size());
      left[first] += take;
      k -= take;
      if (left[first].size() == 0) ++first;
    }
  }
  return Status::Ok();
}

Status ReadFrameWith(const std::function<Status(void*, size_t)>& read_exactly, InFrame& in, uint64_t max_frame_bytes,
                     const std::string& limit_name, const Landing* landing) {
  uint32_t first[2];
  PSD_RETURN_IF_ERROR(read_exactly(first, sizeof(first)));
  uint32_t count = 0;
  size_t rest = 0;
  PSD_RETURN_IF_ERROR(ParseFirstWord(first, &count, &rest));
  std::vector<uint32_t> table(1 + rest / 4);
  table[0] = first[1];
  if (rest) PSD_RETURN_IF_ERROR(read_exactly(table.data() + 1, rest));
  std::vector<uint32_t> sizes;
  uint64_t total = 0;
  PSD_RETURN_IF_ERROR(ParseSegmentSizes(table.data(), count, max_frame_bytes, &sizes, &total, limit_name));
  if (landing != nullptr && landing->dst != nullptr && sizes.size() == 2 &&
      static_cast<uint64_t>(sizes[1]) * sizeof(capnp::word) == landing->bytes &&
      reinterpret_cast<uintptr_t>(landing->dst) % sizeof(capnp::word) == 0) {
    capnp::word* first_segment = in.PrepareLanded(sizes, *landing);
    PSD_RETURN_IF_ERROR(read_exactly(first_segment, sizes[0] * sizeof(capnp::word)));
    return read_exactly(landing->dst, landing->bytes);
  }
  capnp::word* body = in.Prepare(sizes, total);
  return read_exactly(body, total * sizeof(capnp::word));
}

size_t ReadAhead::Take(void* dst, size_t n) {
  size_t take = std::min(n, held());
  if (take > 0) std::memcpy(dst, buf_.get() + begin_, take);
  begin_ += take;
  if (begin_ == end_) begin_ = end_ = 0;
  return take;
}

uint8_t* ReadAhead::Room() {
  if (!buf_) buf_.reset(new uint8_t[bytes_]);
  return buf_.get() + end_;
}

Status ReadFrame(tcp::socket& socket, InFrame& in, uint64_t max_frame_bytes, Deadline deadline,
                 const std::string& limit_name, const Landing* landing, int64_t busy_poll_us, ReadAhead* ahead) {
  MakeNonBlocking(socket);
  return ReadFrameWith([&](void* p, size_t n) { return ReadExactly(socket, p, n, deadline, busy_poll_us, ahead); }, in,
                       max_frame_bytes, limit_name, landing);
}

Code FromWire(proto::Code code) {
  auto v = static_cast<int>(code);
  if (v < 0 || v > static_cast<int>(Code::kAborted)) return Code::kInternal;
  return static_cast<Code>(v);
}

proto::Code ToWire(Code code) { return static_cast<proto::Code>(static_cast<int>(code)); }

Result<DType> FromWire(proto::DType dtype) {
  switch (dtype) {
    case proto::DType::FLOAT32:
      return DType::kFloat32;
    case proto::DType::FLOAT64:
      return DType::kFloat64;
    case proto::DType::BFLOAT16:
      return DType::kBFloat16;
    case proto::DType::FLOAT16:
      return DType::kFloat16;
  }
  return InvalidArgument("unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

proto::DType ToWire(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return proto::DType::FLOAT64;
    case DType::kBFloat16:
      return proto::DType::BFLOAT16;
    case DType::kFloat16:
      return proto::DType::FLOAT16;
    case DType::kFloat32:
      break;
  }
  return proto::DType::FLOAT32;
}

Result<TensorRef> ReadTensor(proto::Tensor::Reader t, uint64_t max_bytes, bool in_shm_ok) {
  if (t.getInShm() && !in_shm_ok) {
    return InvalidArgument(
        "a tensor in shared memory where only one in the message is taken (shared memory "
        "carries pushed gradients and pulled values only)");
  }
  auto dtype = FromWire(t.getDtype());
  if (!dtype.ok()) return dtype.status();
  TensorRef ref;
  ref.dtype = *dtype;
  auto shape = t.getShape();
  if (shape.size() > 32) return InvalidArgument("tensor rank " + std::to_string(shape.size()) + " exceeds 32");
  ref.shape.reserve(shape.size());
  for (int64_t d : shape) ref.shape.push_back(d);
  PSD_RETURN_IF_ERROR(ValidateShape(ref.shape, ref.dtype, max_bytes));
  auto data = t.getData();
  ref.data = data.begin();
  ref.bytes = data.size();
  return ref;
}

void SetTensor(capnp::MessageBuilder& msg, proto::Tensor::Builder t, DType dtype, const Shape& shape, const void* data,
               size_t bytes, bool padded) {
  t.setDtype(ToWire(dtype));
  auto s = t.initShape(static_cast<unsigned>(shape.size()));
  for (size_t i = 0; i < shape.size(); ++i) s.set(static_cast<unsigned>(i), shape[i]);
  if (bytes == 0) return;
  bool aligned = reinterpret_cast<uintptr_t>(data) % sizeof(capnp::word) == 0;
  if (bytes >= kZeroCopyMinBytes && aligned && (padded || bytes % sizeof(capnp::word) == 0)) {
    t.adoptData(
        msg.getOrphanage().referenceExternalData(capnp::Data::Reader(static_cast<const kj::byte*>(data), bytes)));
  } else {
    std::memcpy(t.initData(static_cast<unsigned>(bytes)).begin(), data, bytes);
  }
}

void NameInShm(proto::Tensor::Builder t, DType dtype, const Shape& shape, unsigned segment, uint64_t offset) {
  t.setDtype(ToWire(dtype));
  auto dims = t.initShape(static_cast<unsigned>(shape.size()));
  for (size_t i = 0; i < shape.size(); ++i) dims.set(static_cast<unsigned>(i), shape[i]);
  t.setInShm(true);
  t.setShmOffset(offset);
  t.setShmSegment(static_cast<uint8_t>(segment));
}

}  // namespace psd::wire
