// The workloads of a psd_bench training run: what one worker creates, pulls, computes and pushes
// each iteration (dense variables, or a sparse embedding's rows).
#ifndef PSD_BENCH_WORKLOADS_H_
#define PSD_BENCH_WORKLOADS_H_

#include <algorithm>
#include <cmath>
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

// The rows a sparse worker pulls and pushes each step: `batch` distinct rows of [0, total),
// sorted. `zipf` 0: uniform (Floyd's sampling, O(batch)). `zipf` s > 0: rows drawn with
// probability proportional to 1 / (row + 1)^s until `batch` are distinct (row 0 the most frequent,
// as in a vocabulary sorted by frequency, where the hot rows are the low ids), by rejection-inversion
// (Hoermann and Derflinger, "Rejection-inversion to generate variates from monotone discrete
// distributions", 1996: O(1) memory and time a draw); a skew so steep that 64 x batch draws bring
// fewer distinct rows ends the batch with uniform ones.
class RowSampler {
 public:
  RowSampler(int64_t total, int64_t batch, double zipf, uint64_t seed)
      : total_(total), batch_(batch), zipf_(zipf), rng_(seed) {
    chosen_.reserve(static_cast<size_t>(batch) * 2);
    if (zipf_ > 0) {
      h_x1_ = HIntegral(1.5) - 1.0;
      h_n_ = HIntegral(static_cast<double>(total_) + 0.5);
      s_ = 2.0 - HIntegralInverse(HIntegral(2.5) - H(2.0));
    }
  }
  void Next(std::vector<int64_t>* rows) {
    chosen_.clear();
    if (zipf_ > 0) {
      for (int64_t draws = 0; static_cast<int64_t>(chosen_.size()) < batch_ && draws < 64 * batch_; ++draws) {
        chosen_.insert(Zipf() - 1);
      }
      // The rest uniform (rejection: the callers keep batch <= total / 2 with a skew).
      std::uniform_int_distribution<int64_t> any(0, total_ - 1);
      filled_uniformly_ += batch_ - static_cast<int64_t>(chosen_.size());
      while (static_cast<int64_t>(chosen_.size()) < batch_) chosen_.insert(any(rng_));
    } else {
      for (int64_t j = total_ - batch_; j < total_; ++j) {
        int64_t t = std::uniform_int_distribution<int64_t>(0, j)(rng_);
        if (!chosen_.insert(t).second) chosen_.insert(j);
      }
    }
    rows->assign(chosen_.begin(), chosen_.end());
    std::sort(rows->begin(), rows->end());
  }
  // Rows drawn uniformly so far because the skew gave too few distinct ones.
  int64_t filled_uniformly() const { return filled_uniformly_; }

 private:
  // One Zipf draw in [1, total].
  int64_t Zipf() {
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    for (;;) {
      const double u = h_n_ + unit(rng_) * (h_x1_ - h_n_);
      const double x = HIntegralInverse(u);
      const int64_t k = std::clamp<int64_t>(static_cast<int64_t>(x + 0.5), 1, total_);
      if (static_cast<double>(k) - x <= s_ ||
          u >= HIntegral(static_cast<double>(k) + 0.5) - H(static_cast<double>(k))) {
        return k;
      }
    }
  }
  double H(double x) const { return std::exp(-zipf_ * std::log(x)); }
  // The integral of H: ((x^(1-s)) - 1) / (1 - s), log(x) at s = 1 (both through Helper2).
  double HIntegral(double x) const {
    const double log_x = std::log(x);
    return Helper2((1.0 - zipf_) * log_x) * log_x;
  }
  double HIntegralInverse(double x) const {
    double t = x * (1.0 - zipf_);
    if (t < -1.0) t = -1.0;  // rounding: the inverse is defined from -1 on
    return std::exp(Helper1(t) * x);
  }
  // log(1 + x) / x and (exp(x) - 1) / x, both 1 at 0 (exact near it, by their series).
  static double Helper1(double x) {
    return std::abs(x) > 1e-8 ? std::log1p(x) / x : 1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x));
  }
  static double Helper2(double x) {
    return std::abs(x) > 1e-8 ? std::expm1(x) / x : 1.0 + x * 0.5 * (1.0 + x * (1.0 / 3.0) * (1.0 + 0.25 * x));
  }

  const int64_t total_;
  const int64_t batch_;
  const double zipf_;
  std::mt19937_64 rng_;
  std::unordered_set<int64_t> chosen_;
  double h_x1_ = 0, h_n_ = 0, s_ = 0;
  int64_t filled_uniformly_ = 0;
};

class SparseWorkload : public Workload {
 public:
  // With `shared` (--shared-buffers): the pulled rows and the gradient live in its shared buffers.
  SparseWorkload(int index, const Options& opt, psclient::Client* shared)
      : rows_total_(opt.embedding_rows),
        dim_(opt.embedding_dim),
        batch_(opt.batch_rows),
        sampler_(opt.embedding_rows, opt.batch_rows, opt.zipf, opt.seed + static_cast<uint64_t>(index)),
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
  void Next() override { sampler_.Next(&batch_rows_); }
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
  RowSampler sampler_;
  const float bias_;
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
