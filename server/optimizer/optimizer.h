// Optimizer: the server-side update rule applied once per global step to each trainable
// variable with its aggregated gradient. Slots (per-variable optimizer state such as momentum)
// are held beside the variable and passed in; the optimizer owns no per-variable state.
//
// Thread-safety: Apply may run concurrently for different variables; an optimizer's own fields
// are read-only after construction except the learning rate (atomic).
#ifndef PSD_SERVER_OPTIMIZER_OPTIMIZER_H_
#define PSD_SERVER_OPTIMIZER_OPTIMIZER_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "psd/status.h"
#include "psd/tensor.h"
#include "sync/buffer.h"

namespace psd::server {

struct ApplyArgs {
  DType dtype;
  int64_t num_elements;
  const void* value;        // the published value (read-only: pulls may be reading it)
  const void* grad;         // the aggregated gradient
  void* out;                // where the new value goes (a different buffer than value)
  std::vector<Buffer>* slots;  // this variable's slots, in SlotNames() order; updated in place
  int64_t step;             // the global step being completed (1 for the first update)
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual const char* name() const = 0;
  virtual std::vector<std::string> SlotNames() const = 0;
  virtual void Apply(const ApplyArgs& args) = 0;

  double learning_rate() const { return learning_rate_.load(std::memory_order_relaxed); }
  void set_learning_rate(double lr) { learning_rate_.store(lr, std::memory_order_relaxed); }

 protected:
  explicit Optimizer(double lr) : learning_rate_(lr) {}

 private:
  std::atomic<double> learning_rate_;
};

// Plain gradient descent: value - lr * grad. No slots.
class SgdOptimizer : public Optimizer {
 public:
  explicit SgdOptimizer(double lr) : Optimizer(lr) {}
  const char* name() const override { return "sgd"; }
  std::vector<std::string> SlotNames() const override { return {}; }
  void Apply(const ApplyArgs& args) override;
};

Result<std::unique_ptr<Optimizer>> MakeOptimizer(const std::string& name, double learning_rate);

}  // namespace psd::server

#endif  // PSD_SERVER_OPTIMIZER_OPTIMIZER_H_
