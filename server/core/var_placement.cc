#include "core/var_placement.h"

namespace psd::server {

Shape VarPlacement::PartShape(size_t i) const {
  Shape s = shape;
  if (sliced && i < parts.size()) s[0] = parts[i].row_end - parts[i].row_begin;
  return s;
}

int VarPlacement::PartOn(int shard) const {
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].shard == shard) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace psd::server
