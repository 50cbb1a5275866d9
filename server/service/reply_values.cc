#include "service/reply_values.h"

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
                               unsigned segment_index, uint64_t at, uint64_t end) {
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
    std::memcpy(dst, src, bytes);
  } else {
    ConvertElements(src, dtype, dst, want, count);
  }
  const Shape out = range != nullptr ? Shape{range->count} : shape;
  t.setDtype(wire::ToWire(want));
  auto dims = t.initShape(static_cast<unsigned>(out.size()));
  for (size_t i = 0; i < out.size(); ++i) dims.set(static_cast<unsigned>(i), out[i]);
  t.setInShm(true);
  t.setShmOffset(at);
  t.setShmSegment(static_cast<uint8_t>(segment_index));
  return bytes;
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

Status CheckWanted(const std::string& what, DType declared, DType want) {
  if (ConvertibleDTypes(want, declared)) return Status::Ok();
  return InvalidArgument(what + " is " + DTypeName(declared) + " and cannot be delivered as " + DTypeName(want) +
                         " (float32, bfloat16 and float16 convert to one another; float64 only to itself)");
}

Result<DType> WantedDType(bool has, proto::DType wire_dtype, const std::string& name, DType declared) {
  if (!has) return declared;
  auto d = wire::FromWire(wire_dtype);
  if (!d.ok()) return d.status();
  PSD_RETURN_IF_ERROR(CheckWanted("variable '" + name + "'", declared, *d));
  return *d;
}

}  // namespace psd::server
