#include "sparse_check.h"

#include <string>

namespace psclient::internal {

Status CheckSparseGradient(const SparseGradient& g, const Shape* variable_shape) {
  auto S = [](int64_t v) { return std::to_string(v); };
  auto fail = [&](const std::string& tf_text) {
    return psd::InvalidArgument("sparse gradient for '" + g.name + "': " + tf_text);
  };
  const int64_t nnz = static_cast<int64_t>(g.indices.size());
  if (g.values.shape.empty()) return fail("Values cannot be 0-dimensional.");
  if (g.values.shape[0] != nnz)
    return fail("Expected " + S(nnz) + " non-empty input values, got " + S(g.values.shape[0]));
  if (variable_shape == nullptr || variable_shape->empty()) return Status::Ok();
  const Shape& declared = *variable_shape;
  if (g.dense_shape) {
    const Shape& ds = *g.dense_shape;
    if (declared.size() > ds.size()) {
      return fail("Shape mismatch: expected shape rank at least " + S(static_cast<int64_t>(declared.size())) +
                  ", got " + S(static_cast<int64_t>(ds.size())));
    }
    for (size_t i = 0; i < declared.size(); ++i) {
      if (ds[i] != declared[i]) {
        return fail("Shape mismatch: expected shape dim " + S(static_cast<int64_t>(i)) + " to be " + S(declared[i]) +
                    ", got " + S(ds[i]));
      }
    }
  }
  for (int64_t i = 0; i < nnz; ++i) {
    int64_t idx = g.indices[static_cast<size_t>(i)];
    if (idx >= declared[0]) {
      return fail("Shape mismatch: index of slice " + S(i) + " exceeded limits of shape; index is " + S(idx) +
                  " exceeded " + S(declared[0]));
    }
    if (idx < 0) return fail("index of slice " + S(i) + " is negative: " + S(idx));
  }
  return Status::Ok();
}

}  // namespace psclient::internal
