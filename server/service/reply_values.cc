#include "service/reply_values.h"

#include <algorithm>
#include <cstring>

#include "psd/half.h"

namespace psd::server {

Status CheckRange(const ElementRange& range, int64_t elements, const std::string& what) {
  if (range.offset < 0 || range.count <= 0 || range.offset >= elements || range.count > elements - range.offset) {
    return InvalidArgument("elements [" + std::to_string(range.offset) + ", +" + std::to_string(range.count) + ") of " +
                           what + " are outside its " + std::to_string(elements) + " elements");
  }
  return Status::Ok();
}

void SetValue(wire::OutFrame& frame, proto::Tensor::Builder t, const std::shared_ptr<const Buffer>& value, DType dtype,
              const Shape& shape, DType want, ConvertedValues* cache, std::string_view variable,
              const ElementRange* range) {
  std::shared_ptr<const Buffer> out = value;
  if (want != dtype && cache != nullptr && !variable.empty()) {
    out = cache->Get(variable, value, dtype, want);
  } else if (want != dtype) {
    size_t n = value->bytes() / DTypeSize(dtype);
    auto converted = std::make_shared<Buffer>(n * DTypeSize(want), Buffer::Uninitialized{});
    ConvertElements(value->data(), dtype, converted->data(), want, n);
    out = std::move(converted);
  }
  if (range != nullptr) {
    const size_t es = DTypeSize(want);
    // Padded: a range ends inside the buffer or at its end, and the buffer is padded to a word.
    wire::SetTensor(frame.builder, t, want, {range->count},
                    static_cast<const uint8_t*>(out->data()) + static_cast<size_t>(range->offset) * es,
                    static_cast<size_t>(range->count) * es, /*padded=*/true);
  } else {
    wire::SetTensor(frame.builder, t, want, shape, out->data(), out->bytes(), /*padded=*/true);
  }
  frame.keepalive.push_back(std::move(out));
}

Result<uint64_t> SetValueInShm(proto::Tensor::Builder t, const Buffer& value, DType dtype, const Shape& shape,
                               DType want, const ElementRange* range, wire::SharedSegment& segment,
                               unsigned segment_index, uint64_t at, uint64_t end, ThreadPool* helpers) {
  const size_t count = range != nullptr ? static_cast<size_t>(range->count) : value.bytes() / DTypeSize(dtype);
  const size_t first = range != nullptr ? static_cast<size_t>(range->offset) : 0;
  const uint64_t bytes = count * DTypeSize(want);
  uint8_t* dst = at <= end && bytes <= end - at ? segment.At(at, bytes) : nullptr;
  if (dst == nullptr) {
    return InvalidArgument("the values do not fit the shared-memory room the request gave (" + std::to_string(bytes) +
                           " bytes at " + std::to_string(at) + ", " + std::to_string(end) + " bytes end)");
  }
  if (at % DTypeSize(want) != 0) {
    return InvalidArgument("a value of " + std::string(DTypeName(want)) + " asked at shared-memory offset " +
                           std::to_string(at) + ", not a multiple of its element size");
  }
  const uint8_t* src = static_cast<const uint8_t*>(value.data()) + first * DTypeSize(dtype);
  if (want == dtype) {
    if (helpers != nullptr) {
      helpers->ParallelCopy(dst, src, bytes);
    } else {
      std::memcpy(dst, src, bytes);
    }
  } else if (helpers != nullptr) {
    const size_t in_size = DTypeSize(dtype), out_size = DTypeSize(want);
    helpers->ParallelFor(static_cast<int64_t>(count), static_cast<int64_t>(ThreadPool::kCopyGrain / in_size),
                         [&](int64_t b, int64_t e) {
                           ConvertElements(src + static_cast<size_t>(b) * in_size, dtype,
                                           dst + static_cast<size_t>(b) * out_size, want, static_cast<size_t>(e - b));
                         });
  } else {
    ConvertElements(src, dtype, dst, want, count);
  }
  wire::NameInShm(t, want, range != nullptr ? Shape{range->count} : shape, segment_index, at);
  return bytes;
}

Status RowsOut::Begin(DType dtype, DType declared, const Shape& shape) {
  auto want = WantedDType(has_dtype_, wire_dtype_, name_, declared);
  if (!want.ok()) return want.status();
  dtype_ = dtype;
  want_ = *want;
  shape_ = shape;
  row_elements_ = NumElements(Shape(shape.begin() + 1, shape.end()));
  row_bytes_ = static_cast<uint64_t>(row_elements_) * DTypeSize(want_);
  // bytes() (rows × row bytes) must not wrap: a wrapped size would pass the room checks below.
  const uint64_t rows_asked = static_cast<uint64_t>(shape_.empty() ? 0 : std::max<int64_t>(shape_[0], 0));
  if (row_bytes_ > 0 && rows_asked > UINT64_MAX / row_bytes_) {
    return InvalidArgument("the rows of '" + name_ + "' asked are more bytes than any reply can hold");
  }
  if (target_ == nullptr || segment_ == nullptr) return InFrame();
  const auto& offsets = target_->offsets;
  const size_t rows = static_cast<size_t>(shape_[0]);
  // The room: `bytes` from its start (in the shared buffers without `bytes`: to the segment's end).
  const uint64_t start = offsets.empty() ? target_->offset : offsets[0];
  const uint64_t end =
      target_->bytes == 0 && !offsets.empty() ? UINT64_MAX : start + std::min(target_->bytes, UINT64_MAX - start);
  if (offsets.empty()) {  // segment 0's room, or the reply when they do not fit it
    if (!Fits(target_->offset, bytes(), end, "the rows").ok()) return InFrame();
    where_ = Where::kShm;
    first_ = segment_->data() + target_->offset;
    return Status::Ok();
  }
  if (offsets.size() == 1) {  // in place, one after another
    PSD_RETURN_IF_ERROR(Fits(offsets[0], bytes(), end, "the rows"));
    where_ = Where::kShm;
    first_ = segment_->data() + offsets[0];
    return Status::Ok();
  }
  if (offsets.size() != rows) {
    return InvalidArgument("the request gives " + std::to_string(offsets.size()) + " shared-memory offsets for " +
                           std::to_string(rows) + " rows of '" + name_ + "' (one, or one per row)");
  }
  for (uint64_t at : offsets) PSD_RETURN_IF_ERROR(Fits(at, row_bytes_, UINT64_MAX, "a row"));
  where_ = Where::kShmPerRow;
  return Status::Ok();
}

Status RowsOut::Fits(uint64_t at, uint64_t bytes, uint64_t end, const char* what) const {
  if (at > end || bytes > end - at || segment_->At(at, bytes) == nullptr) {
    std::string shape;
    for (int64_t d : shape_) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    return InvalidArgument(std::string(what) + " of '" + name_ + "' ([" + shape + "] " + DTypeName(want_) + ", " +
                           std::to_string(bytes) + " bytes at shared-memory offset " + std::to_string(at) +
                           ") do not fit the room the request gave: is the view [rows asked, the variable's row "
                           "dims]?");
  }
  if (at % DTypeSize(want_) != 0) {
    return InvalidArgument("rows of '" + name_ + "' in " + DTypeName(want_) + " asked at shared-memory offset " +
                           std::to_string(at) + ", not a multiple of its element size");
  }
  return Status::Ok();
}

Status RowsOut::InFrame() {
  const uint64_t rows = static_cast<uint64_t>(shape_[0]);
  if (row_bytes_ > 0 && rows > max_frame_bytes_ / row_bytes_) {
    return ResourceExhausted(std::to_string(rows) + " rows of '" + name_ + "' (" + std::to_string(row_bytes_) +
                             " bytes each) do not fit one reply of --max-frame-bytes " +
                             std::to_string(max_frame_bytes_) + ": ask for fewer rows at a time");
  }
  where_ = Where::kFrame;
  buffer_ = std::make_shared<Buffer>(bytes(), Buffer::Uninitialized{});
  first_ = static_cast<uint8_t*>(buffer_->data());
  return Status::Ok();
}

void RowsOut::Row(size_t i, const uint8_t* src) {
  uint8_t* dst = where_ == Where::kShmPerRow ? segment_->data() + target_->offsets[i] : first_ + i * row_bytes_;
  if (want_ == dtype_) {
    std::memcpy(dst, src, row_bytes_);
  } else {
    ConvertElements(src, dtype_, dst, want_, static_cast<size_t>(row_elements_));
  }
}

void RowsOut::Set(wire::OutFrame& frame, proto::Tensor::Builder t) {
  if (where_ == Where::kFrame) {
    wire::SetTensor(frame.builder, t, want_, shape_, buffer_->data(), bytes(), /*padded=*/true);
    frame.keepalive.push_back(std::move(buffer_));
    return;
  }
  wire::NameInShm(t, want_, shape_, target_->segment,
                  where_ == Where::kShmPerRow ? target_->offsets[0] : static_cast<uint64_t>(first_ - segment_->data()));
}

Result<std::vector<std::optional<DType>>> WantedDTypes(capnp::List<proto::DType>::Reader in, size_t names) {
  std::vector<std::optional<DType>> out(names);
  if (in.size() == 0) return out;
  if (in.size() != names) {
    return InvalidArgument("the request names " + std::to_string(names) + " variables but " +
                           std::to_string(in.size()) + " dtypes");
  }
  for (unsigned i = 0; i < in.size(); ++i) {
    auto d = wire::FromWire(in[i]);
    if (!d.ok()) return d.status();
    out[i] = *d;
  }
  return out;
}

Status CheckWanted(const std::string& name, DType declared, DType want) {
  if (ConvertibleDTypes(want, declared)) return Status::Ok();
  return InvalidArgument("variable '" + name + "' is " + DTypeName(declared) + " and cannot be delivered as " +
                         DTypeName(want) +
                         " (float32, bfloat16 and float16 convert to one another; float64 only to itself)");
}

Result<DType> WantedDType(bool has, proto::DType wire_dtype, const std::string& name, DType declared) {
  if (!has) return declared;
  auto d = wire::FromWire(wire_dtype);
  if (!d.ok()) return d.status();
  PSD_RETURN_IF_ERROR(CheckWanted(name, declared, *d));
  return *d;
}

}  // namespace psd::server
