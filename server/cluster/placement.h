// Placement: which shard(s) of a cluster hold each variable.
//
// Rule (deterministic for a given order of Place calls):
//  - a variable of at most `slice_bytes` goes whole to the shard with the fewest bytes placed so
//    far (ties: the lowest index), so bytes per shard stay balanced rather than round-robin;
//  - a bigger one is split along its first dimension into n = min(shards, ceil(bytes /
//    slice_bytes), rows) slices of near-equal rows (the first ones get the extra row), put on the
//    n least-loaded shards (at most one slice per shard), slice i on the i-th least loaded;
//  - `colocate_with` names an existing variable: the new one goes to the same shard(s) — the same
//    row split when it has as many rows as a sliced target, else whole onto the target's first
//    shard.
// Placing a name again returns the existing placement if dtype and shape match (create-or-get),
// AlreadyExists otherwise.
//
// Thread-safety: none; the owner (the chief's coordinator) locks.
#ifndef PSD_SERVER_CLUSTER_PLACEMENT_H_
#define PSD_SERVER_CLUSTER_PLACEMENT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/var_placement.h"
#include "psd/status.h"
#include "psd/tensor.h"

namespace psd::server {

class PlacementMap {
 public:
  PlacementMap(int shards, uint64_t slice_bytes) : shards_(shards), slice_bytes_(slice_bytes) {}

  Result<VarPlacement> Place(const std::string& name, DType dtype, const Shape& shape,
                             const std::string& colocate_with = "", bool trainable = true);
  // Shards holding a part of a trainable variable.
  std::vector<bool> TrainingShards() const;
  // Records a placement made earlier (rebuilding the map from the shards after a restore).
  // A different placement already recorded under the name is AlreadyExists.
  Status Add(const VarPlacement& p);
  const VarPlacement* Find(const std::string& name) const;
  std::vector<VarPlacement> All() const;
  const std::vector<uint64_t>& shard_bytes() const { return bytes_; }
  void Clear();
  int shards() const { return shards_; }

 private:
  void Account(const VarPlacement& p);
  // Shards ordered by bytes placed, then index.
  std::vector<int> LeastLoaded() const;

  const int shards_;
  const uint64_t slice_bytes_;
  std::vector<uint64_t> bytes_ = std::vector<uint64_t>(static_cast<size_t>(shards_), 0);
  std::map<std::string, VarPlacement> vars_;
};

}  // namespace psd::server

#endif  // PSD_SERVER_CLUSTER_PLACEMENT_H_
