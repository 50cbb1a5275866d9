// The checks TensorFlow's SparseConditionalAccumulator makes on an IndexedSlices gradient
// (shared/reference/tf_semantics.md §2.1), made by the client before anything is sent, with TF's
// texts — those the client can make: the daemon checks the rest (dtype, the values' row shape
// against the variable) with the same texts.
#ifndef PSCLIENT_SRC_SPARSE_CHECK_H_
#define PSCLIENT_SRC_SPARSE_CHECK_H_

#include "psclient/client.h"

namespace psclient::internal {

// `variable_shape`: the whole variable's shape when the client knows it (a cluster's placement),
// else nullptr. In TF's order: values rank 0, values' first dimension against the number of
// indices, then (shape known) the dense shape's rank and dimensions and every index against the
// first dimension (negative indices are refused too: psd's rule). kInvalidArgument naming the
// variable.
Status CheckSparseGradient(const SparseGradient& g, const Shape* variable_shape);

}  // namespace psclient::internal

#endif  // PSCLIENT_SRC_SPARSE_CHECK_H_
