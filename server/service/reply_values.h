// How values leave the daemon in replies, and the dtypes a request may ask them in: shared by
// the worker session's handlers (pulls, pushes with pull_after, collectives).
#ifndef PSD_SERVER_SERVICE_REPLY_VALUES_H_
#define PSD_SERVER_SERVICE_REPLY_VALUES_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/buffer.h"
#include "core/converted_values.h"
#include "psd/status.h"
#include "psd/tensor.h"
#include "wire/frame.h"
#include "wire/shm.h"

namespace psd::server {

// Elements [offset, offset + count) of a flattened value (Pull.ranges).
struct ElementRange {
  int64_t offset;
  int64_t count;
};

// INVALID_ARGUMENT naming `what` unless `range` is a non-empty run inside a value of `elements`.
Status CheckRange(const ElementRange& range, int64_t elements, const std::string& what);

// Puts a value the engine handed out into a reply tensor as dtype `want`: referenced in place
// (kept alive by the frame) when it already is, else converted — how half-precision variables
// leave the daemon, and how a reader asks for another dtype. With `cache` (a published value of
// `variable`), the conversion is shared by every reader of that value. With `range`, only its
// elements [offset, offset + count), as a flat [count] (checked by the caller).
void SetValue(wire::OutFrame& frame, proto::Tensor::Builder t, const std::shared_ptr<const Buffer>& value, DType dtype,
              const Shape& shape, DType want, ConvertedValues* cache = nullptr, std::string_view variable = {},
              const ElementRange* range = nullptr);

// Where in a connection's shared memory a reply's values go (Pull.toShm): in segment 0, each at a
// multiple of 64 bytes from `offset`, within `bytes`; or, with `offsets` (one per value), each at
// its own offset of `segment` (the worker's shared buffers: in place).
struct ShmTarget {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint8_t segment = 0;
  std::vector<uint64_t> offsets;
};

// Writes a value as SetValue would deliver it (dtype `want`, `range`) into `segment` (number
// `segment_index` of the connection's) at `at`, ending by `end`, and says where in `t` (inShm,
// shmOffset, shmSegment). Returns the bytes written. The pages are the worker's: they are only
// written, within bounds. INVALID_ARGUMENT when it does not fit or `at` is not a multiple of the
// element size.
Result<uint64_t> SetValueInShm(proto::Tensor::Builder t, const Buffer& value, DType dtype, const Shape& shape,
                               DType want, const ElementRange* range, wire::SharedSegment& segment,
                               unsigned segment_index, uint64_t at, uint64_t end);

// The dtypes a request asks for, one per name (empty list: each variable's own). Errors name the
// mismatch; an unknown dtype is INVALID_ARGUMENT.
Result<std::vector<std::optional<DType>>> WantedDTypes(capnp::List<proto::DType>::Reader in, size_t names);

// A float dtype a reader may ask a variable of `declared` to be delivered in.
Status CheckWanted(const std::string& what, DType declared, DType want);

// The dtype to deliver one value in: the request's (has/wire) when set and valid, else `declared`.
Result<DType> WantedDType(bool has, proto::DType wire_dtype, const std::string& name, DType declared);

}  // namespace psd::server

#endif  // PSD_SERVER_SERVICE_REPLY_VALUES_H_
