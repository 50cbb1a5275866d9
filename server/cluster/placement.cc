#include "cluster/placement.h"

#include <algorithm>
#include <numeric>

namespace psd::server {

std::vector<int> PlacementMap::LeastLoaded() const {
  std::vector<int> order(static_cast<size_t>(shards_));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return bytes_[a] < bytes_[b]; });
  return order;
}

void PlacementMap::Account(const VarPlacement& p) {
  size_t row_bytes = p.shape.empty() || p.shape[0] == 0 ? p.bytes() : p.bytes() / static_cast<size_t>(p.shape[0]);
  for (const SlicePart& part : p.parts) {
    bytes_[static_cast<size_t>(part.shard)] +=
        p.sliced ? row_bytes * static_cast<size_t>(part.row_end - part.row_begin) : p.bytes();
  }
}

Result<VarPlacement> PlacementMap::Place(const std::string& name, DType dtype, const Shape& shape,
                                         const std::string& colocate_with, bool trainable) {
  if (const VarPlacement* have = Find(name)) {
    if (have->dtype != dtype || have->shape != shape) {
      return AlreadyExists("variable '" + name + "' is placed as " + DTypeName(have->dtype) + " " +
                           ShapeString(have->shape) + "; requested " + DTypeName(dtype) + " " + ShapeString(shape));
    }
    return *have;
  }
  VarPlacement p;
  p.name = name;
  p.dtype = dtype;
  p.shape = shape;
  p.trainable = trainable;
  const int64_t rows = shape.empty() ? 1 : shape[0];
  if (!colocate_with.empty()) {
    const VarPlacement* target = Find(colocate_with);
    if (target == nullptr) return NotFound("colocate_with: no variable named '" + colocate_with + "'");
    if (target->sliced && !shape.empty() && rows == target->shape[0]) {
      p.sliced = true;
      p.parts = target->parts;
    } else {
      p.parts = {{target->parts[0].shard, 0, rows}};
    }
  } else {
    uint64_t bytes = p.bytes();
    int64_t n = 1;
    if (bytes > slice_bytes_ && !shape.empty()) {
      n = static_cast<int64_t>((bytes + slice_bytes_ - 1) / slice_bytes_);
      n = std::min<int64_t>({n, shards_, rows});
    }
    std::vector<int> order = LeastLoaded();
    if (n <= 1) {
      p.parts = {{order[0], 0, rows}};
    } else {
      p.sliced = true;
      int64_t begin = 0;
      for (int64_t i = 0; i < n; ++i) {
        int64_t len = rows / n + (i < rows % n ? 1 : 0);
        p.parts.push_back({order[static_cast<size_t>(i)], begin, begin + len});
        begin += len;
      }
    }
  }
  Account(p);
  vars_.emplace(name, p);
  return p;
}

Status PlacementMap::Add(const VarPlacement& p) {
  if (p.parts.empty()) return InvalidArgument("placement of '" + p.name + "' has no parts");
  for (const SlicePart& part : p.parts) {
    if (part.shard < 0 || part.shard >= shards_) {
      return InvalidArgument("placement of '" + p.name + "' names shard " + std::to_string(part.shard) +
                             " of a cluster of " + std::to_string(shards_));
    }
  }
  if (const VarPlacement* have = Find(p.name)) {
    if (!(*have == p)) return AlreadyExists("variable '" + p.name + "' is placed differently on another shard");
    return Status::Ok();
  }
  Account(p);
  vars_.emplace(p.name, p);
  return Status::Ok();
}

const VarPlacement* PlacementMap::Find(const std::string& name) const {
  auto it = vars_.find(name);
  return it == vars_.end() ? nullptr : &it->second;
}

std::vector<VarPlacement> PlacementMap::All() const {
  std::vector<VarPlacement> out;
  for (const auto& [name, p] : vars_) out.push_back(p);
  return out;
}

std::vector<bool> PlacementMap::TrainingShards() const {
  std::vector<bool> out(static_cast<size_t>(shards_), false);
  for (const auto& [name, p] : vars_) {
    if (!p.trainable) continue;
    for (const SlicePart& part : p.parts) out[static_cast<size_t>(part.shard)] = true;
  }
  return out;
}

void PlacementMap::Clear() {
  vars_.clear();
  std::fill(bytes_.begin(), bytes_.end(), 0);
}

}  // namespace psd::server
