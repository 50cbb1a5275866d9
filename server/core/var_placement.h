// VarPlacement: where the parts of one variable live in a cluster (which shard holds which rows).
// A value type of the training core: every variable records the whole variable it is a part of,
// and checkpoints keep it. How placements are chosen is the cluster's business (cluster/placement.h).
#ifndef PSD_SERVER_CORE_VAR_PLACEMENT_H_
#define PSD_SERVER_CORE_VAR_PLACEMENT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "psd/tensor.h"

namespace psd::server {

struct SlicePart {
  int shard = 0;
  int64_t row_begin = 0;  // sliced: the rows [row_begin, row_end) of the whole variable
  int64_t row_end = 0;
  bool operator==(const SlicePart& o) const {
    return shard == o.shard && row_begin == o.row_begin && row_end == o.row_end;
  }
};

struct VarPlacement {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;          // the whole variable
  bool sliced = false;  // false: parts has one entry holding the whole variable
  std::vector<SlicePart> parts;
  bool trainable = true;  // the chief waits for every shard holding a trainable part

  size_t bytes() const { return static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype); }
  // The shape of part `i` (the whole shape when not sliced).
  Shape PartShape(size_t i) const;
  // The index of the part on `shard`, or -1.
  int PartOn(int shard) const;
  bool operator==(const VarPlacement& o) const {
    return name == o.name && dtype == o.dtype && shape == o.shape && sliced == o.sliced && parts == o.parts;
  }
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_VAR_PLACEMENT_H_
