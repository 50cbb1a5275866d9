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
#include "core/training_engine.h"
#include "psd/status.h"
#include "psd/tensor.h"
#include "wire/frame.h"
#include "wire/shm.h"

namespace psd::server {

// Elements [offset, offset + count) of a flattened value (Pull.ranges).
struct ElementRange {
  int64_t offset;
  int64_t count;
  Shape whole_shape = {};  // a pull's: the shape the caller expects of the whole value (empty: any)
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
  bool values = false;  // the worker maps the daemon's values segment (ShmTarget.values)
};

// Writes a value as SetValue would deliver it (dtype `want`, `range`) into `segment` (number
// `segment_index` of the connection's) at `at`, ending by `end`, and says where in `t` (inShm,
// shmOffset, shmSegment). Returns the bytes written. The pages are the worker's: they are only
// written, within bounds. INVALID_ARGUMENT when it does not fit or `at` is not a multiple of the
// element size. `helpers`: a pool whose idle threads copy (or convert) part of a big value.
Result<uint64_t> SetValueInShm(proto::Tensor::Builder t, const Buffer& value, DType dtype, const Shape& shape,
                               DType want, const ElementRange* range, wire::SharedSegment& segment,
                               unsigned segment_index, uint64_t at, uint64_t end, ThreadPool* helpers = nullptr);

// Where the rows of a PullRows go (TrainingEngine::ReadRows' sink), in the dtype the request asks
// (has/wire; else the variable's own), converted row by row as they are read:
//   - no `target`: into one buffer the reply frame keeps, at most `max_frame_bytes`;
//   - segment 0 (the connection's own): one after another in the room the request gave, or, when
//     they do not fit it, into the reply frame as above;
//   - segment 1 (the worker's shared buffers, in place): one after another from offsets[0], within
//     `bytes` when set; or, with one offset per row, each row at its own offset.
// Every row's place is checked (inside the segment, aligned to the element size) before a row is
// read; the pages are the worker's and are only written.
class RowsOut : public RowSink {
 public:
  RowsOut(bool has_dtype, proto::DType wire_dtype, std::string name, uint64_t max_frame_bytes,
          const ShmTarget* target = nullptr, wire::SharedSegment* segment = nullptr)
      : has_dtype_(has_dtype),
        wire_dtype_(wire_dtype),
        name_(std::move(name)),
        max_frame_bytes_(max_frame_bytes),
        target_(target),
        segment_(segment) {}
  Status Begin(DType dtype, DType declared, const Shape& shape) override;
  void Row(size_t i, const uint8_t* src) override;
  // After ReadRows: the rows into `t`, or where they are in shared memory.
  void Set(wire::OutFrame& frame, proto::Tensor::Builder t);
  // The bytes written into shared memory (0: the rows went in the reply).
  uint64_t shm_bytes() const { return where_ == Where::kFrame ? 0 : bytes(); }

 private:
  enum class Where { kFrame, kShm, kShmPerRow };
  uint64_t bytes() const { return static_cast<uint64_t>(shape_.empty() ? 0 : shape_[0]) * row_bytes_; }
  Status InFrame();
  // OK when [at, at + bytes) lies in the segment before `end` and `at` is aligned to an element.
  Status Fits(uint64_t at, uint64_t bytes, uint64_t end, const char* what) const;

  const bool has_dtype_;
  const proto::DType wire_dtype_;
  const std::string name_;
  const uint64_t max_frame_bytes_;
  const ShmTarget* const target_;
  wire::SharedSegment* const segment_;
  DType dtype_ = DType::kFloat32;  // the rows as read
  DType want_ = DType::kFloat32;   // ... as delivered
  Shape shape_;
  int64_t row_elements_ = 0;
  uint64_t row_bytes_ = 0;  // delivered
  Where where_ = Where::kFrame;
  uint8_t* first_ = nullptr;        // kFrame, kShm: where row 0 goes (the next rows follow it)
  std::shared_ptr<Buffer> buffer_;  // kFrame
};

// The dtypes a request asks for, one per name (empty list: each variable's own). Errors name the
// mismatch; an unknown dtype is INVALID_ARGUMENT.
Result<std::vector<std::optional<DType>>> WantedDTypes(capnp::List<proto::DType>::Reader in, size_t names);

// A float dtype a reader may ask variable `name` of `declared` to be delivered in (the error's text
// is built only when it is not).
Status CheckWanted(const std::string& name, DType declared, DType want);

// The dtype to deliver one value in: the request's (has/wire) when set and valid, else `declared`.
Result<DType> WantedDType(bool has, proto::DType wire_dtype, const std::string& name, DType declared);

}  // namespace psd::server

#endif  // PSD_SERVER_SERVICE_REPLY_VALUES_H_
