// The workloads of a psd_bench training run: what one worker creates, pulls, computes and pushes
// each iteration (dense variables, or a sparse embedding's rows).
#ifndef PSD_BENCH_WORKLOADS_H_
#define PSD_BENCH_WORKLOADS_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "bench_util.h"
#include "psclient/client.h"
#include "psd/half.h"

namespace psd_bench {

// What one worker pulls and pushes each iteration. Buffers are allocated once: the loop measures
// psd, not the allocator. uint64_t storage keeps tensors 8-byte aligned so libpsclient sends
// them without staging copies.
class Workload {
 public:
  virtual ~Workload() = default;
  // The chief creates the variables (zeros: an empty initial tensor, so creating a big one
  // costs the daemon an allocation, not a transfer).
  virtual Status Create(psclient::Client& c) = 0;
  // The first read; kNotFound until the chief created the variables. Returns the global step.
  virtual Result<int64_t> FirstPull(psclient::Client& c) = 0;
  // Untimed: prepares the next iteration (sparse: draws the batch).
  virtual void Next() {}
  virtual Result<int64_t> Pull(psclient::Client& c) = 0;
  // Timed as part of the step, outside the pull and push latencies.
  virtual void Compute() {}
  virtual Result<psclient::PushOutcome> Push(psclient::Client& c, int64_t local_step, bool wait_token,
                                             int64_t timeout_ms) = 0;
  // Moved per iteration.
  virtual uint64_t pull_bytes() const = 0;
  virtual uint64_t push_bytes() const = 0;
  virtual int64_t rows() const { return 0; }
};

inline std::string CreateHint(const Status& s, const char* flags) {
  return s.code() == psd::Code::kAlreadyExists
             ? std::string(" (a previous run created it with another size: restart psd or use the same ") + flags + ")"
             : "";
}

class DenseWorkload : public Workload {
 public:
  // grad_dtype: what travels: the float32 variables' gradients are pushed, and their values pulled,
  // in it (bfloat16/float16: the daemon sums in float32 and rounds the pulled values).
  // shared: the gradients and values live in its shared buffers (else in plain vectors); check
  // status() after.
  DenseWorkload(int index, const std::vector<VarSpec>& vars, bool pull_in_push, psd::DType grad_dtype,
                psclient::Client* shared)
      : vars_(vars), pull_in_push_(pull_in_push) {
    grads_.reserve(vars.size());
    outs_.reserve(vars.size());
    for (size_t i = 0; i < vars.size(); ++i) {
      const size_t wire_bytes = static_cast<size_t>(vars[i].elements) * psd::DTypeSize(grad_dtype);
      const size_t words = (wire_bytes + 7) / 8;
      // Small per-worker constants: the model drifts slowly and stays finite for any step count.
      const float g = 1e-3f * static_cast<float>(index + 1);
      const float four[4] = {g, g, g, g};
      uint64_t pattern = 0;  // one word of g in grad_dtype
      psd::ConvertElements(four, psd::DType::kFloat32, &pattern, grad_dtype, 8 / psd::DTypeSize(grad_dtype));
      uint64_t* grad = Storage(shared, words);
      uint64_t* value = Storage(shared, words);
      if (!status_.ok()) return;
      std::fill(grad, grad + words, pattern);
      std::fill(value, value + words, 0);
      const psd::Shape shape{vars[i].elements};
      grads_.push_back({vars[i].name, psclient::ConstTensorView{grad, grad_dtype, shape}});
      outs_.emplace_back(vars[i].name, psclient::TensorView{value, grad_dtype, shape});
      model_bytes_ += wire_bytes;
    }
  }
  const Status& status() const { return status_; }
  Status Create(psclient::Client& c) override {
    for (const VarSpec& v : vars_) {
      auto created = c.CreateVariable(v.name, psclient::ConstTensorView{nullptr, psd::DType::kFloat32, {v.elements}});
      if (!created.ok()) {
        return Status(created.status().code(), "create '" + v.name + "': " + created.status().message() +
                                                   CreateHint(created.status(), "--model-bytes and --variables"));
      }
    }
    return Status::Ok();
  }
  Result<int64_t> FirstPull(psclient::Client& c) override { return c.Pull(outs_); }
  Result<int64_t> Pull(psclient::Client& c) override {
    if (fresh_step_ >= 0) {  // --pull-in-push: the values came with the last token
      int64_t step = fresh_step_;
      fresh_step_ = -1;
      return step;
    }
    return c.Pull(outs_);
  }
  Result<psclient::PushOutcome> Push(psclient::Client& c, int64_t local_step, bool wait_token,
                                     int64_t timeout_ms) override {
    auto out = c.Push(local_step, grads_, {}, wait_token, timeout_ms, pull_in_push_ ? &outs_ : nullptr);
    if (out.ok()) fresh_step_ = out->pulled_step;
    return out;
  }
  uint64_t pull_bytes() const override { return model_bytes_; }
  uint64_t push_bytes() const override { return model_bytes_; }

 private:
  // `words` of 8 bytes: shared buffers of `shared` when given, else a vector's.
  uint64_t* Storage(psclient::Client* shared, size_t words) {
    if (shared == nullptr) return plain_.emplace_back(words).data();
    auto b = shared->AllocateShared(words * 8);
    if (!b.ok()) {
      if (status_.ok()) status_ = Status(b.status().code(), "--shared-buffers: " + b.status().message());
      return nullptr;
    }
    return shared_.emplace_back(std::move(*b)).as<uint64_t>();
  }

  const std::vector<VarSpec>& vars_;
  std::deque<std::vector<uint64_t>> plain_;
  std::deque<psclient::SharedBuffer> shared_;
  Status status_;
  std::vector<psclient::Gradient> grads_;
  std::vector<std::pair<std::string, psclient::TensorView>> outs_;
  uint64_t model_bytes_ = 0;
  const bool pull_in_push_;
  int64_t fresh_step_ = -1;
};

// Floyd's sampling: `batch` distinct rows of [0, total) in O(batch), sorted into *rows
// (`chosen` is scratch).
inline void SampleRows(int64_t total, int64_t batch, std::mt19937_64& rng, std::unordered_set<int64_t>* chosen,
                       std::vector<int64_t>* rows) {
  chosen->clear();
  for (int64_t j = total - batch; j < total; ++j) {
    int64_t t = std::uniform_int_distribution<int64_t>(0, j)(rng);
    if (!chosen->insert(t).second) chosen->insert(j);
  }
  rows->assign(chosen->begin(), chosen->end());
  std::sort(rows->begin(), rows->end());
}

class SparseWorkload : public Workload {
 public:
  // With `shared` (--shared-buffers): the pulled rows and the gradient live in its shared buffers.
  SparseWorkload(int index, const Options& opt, psclient::Client* shared)
      : rows_total_(opt.embedding_rows),
        dim_(opt.embedding_dim),
        batch_(opt.batch_rows),
        rng_(opt.seed + static_cast<uint64_t>(index)),
        bias_(1e-3f * static_cast<float>(index + 1)) {
    const size_t bytes = static_cast<size_t>(batch_ * dim_) * sizeof(float);
    for (float** at : {&values_, &grads_}) {
      if (shared == nullptr) {
        *at = reinterpret_cast<float*>(plain_.emplace_back((bytes + 7) / 8).data());
        continue;
      }
      auto b = shared->AllocateShared(bytes);
      if (!b.ok()) {
        status_ = Status(b.status().code(), "--shared-buffers: " + b.status().message());
        return;
      }
      *at = shared_.emplace_back(std::move(*b)).as<float>();
    }
    chosen_.reserve(static_cast<size_t>(batch_) * 2);
    batch_rows_.reserve(static_cast<size_t>(batch_));
    sparse_.resize(1);
    sparse_[0].name = kEmbeddingName;
    sparse_[0].indices.reserve(static_cast<size_t>(batch_));
    sparse_[0].values = psclient::ConstTensorView{grads_, psd::DType::kFloat32, {batch_, dim_}};
  }
  const Status& status() const { return status_; }
  Status Create(psclient::Client& c) override {
    auto created =
        c.CreateVariable(kEmbeddingName, psclient::ConstTensorView{nullptr, psd::DType::kFloat32, {rows_total_, dim_}});
    if (!created.ok()) {
      return Status(created.status().code(), std::string("create '") + kEmbeddingName +
                                                 "': " + created.status().message() +
                                                 CreateHint(created.status(), "--embedding-rows and --embedding-dim"));
    }
    return Status::Ok();
  }
  Result<int64_t> FirstPull(psclient::Client& c) override {
    return c.PullRows(kEmbeddingName, {0}, psclient::TensorView{values_, psd::DType::kFloat32, {1, dim_}});
  }
  void Next() override { SampleRows(rows_total_, batch_, rng_, &chosen_, &batch_rows_); }
  Result<int64_t> Pull(psclient::Client& c) override {
    return c.PullRows(kEmbeddingName, batch_rows_, psclient::TensorView{values_, psd::DType::kFloat32, {batch_, dim_}});
  }
  void Compute() override {
    const int64_t n = batch_ * dim_;
    for (int64_t i = 0; i < n; ++i) grads_[i] = bias_ + 0.01f * values_[i];
  }
  Result<psclient::PushOutcome> Push(psclient::Client& c, int64_t local_step, bool wait_token,
                                     int64_t timeout_ms) override {
    sparse_[0].indices.assign(batch_rows_.begin(), batch_rows_.end());
    return c.Push(local_step, no_dense_, sparse_, wait_token, timeout_ms);
  }
  uint64_t pull_bytes() const override { return static_cast<uint64_t>(batch_) * (dim_ * sizeof(float) + 8); }
  uint64_t push_bytes() const override { return pull_bytes(); }
  int64_t rows() const override { return batch_; }

 private:
  const int64_t rows_total_;
  const int64_t dim_;
  const int64_t batch_;
  std::mt19937_64 rng_;
  const float bias_;
  std::unordered_set<int64_t> chosen_;
  std::vector<int64_t> batch_rows_;
  std::deque<std::vector<uint64_t>> plain_;
  std::deque<psclient::SharedBuffer> shared_;
  Status status_;
  float* values_ = nullptr;  // [batch_, dim_]: the pulled rows
  float* grads_ = nullptr;   // [batch_, dim_]: their gradient
  const std::vector<psclient::Gradient> no_dense_;
  std::vector<psclient::SparseGradient> sparse_;
};

}  // namespace psd_bench

#endif  // PSD_BENCH_WORKLOADS_H_
