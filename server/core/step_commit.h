// StepCommit: how a prepared synchronous step becomes a committed one — the training core's one
// seam to the cluster (README "Architecture").
//
// When every trainable variable of an engine is taken for step s (its values are staged), the
// step is prepared. A single daemon commits it at once: publishes the staged values, bumps the
// global step and releases the step's tokens (LocalStepCommit, the engine's default). A cluster
// shard holds only its part of the model, so its engine reports the prepared step instead and
// waits; the cluster's coordinator calls TrainingEngine::CommitPrepared once every shard has
// prepared s, and the chief releases the tokens once every shard has committed (the daemon's
// ClusterStepCommit, daemon/cluster_host.h).
//
// Thread-safety: OnPrepared is called outside all engine locks, on the thread that completed the
// step's last take (or that called ReportIfIdle); it may call back into the engine.
#ifndef PSD_SERVER_CORE_STEP_COMMIT_H_
#define PSD_SERVER_CORE_STEP_COMMIT_H_

#include <cstdint>

namespace psd::server {

struct PreparedStep {
  int64_t step = 0;       // the global step the prepared values complete (they publish step + 1)
  int min_gradients = 0;  // the fewest gradients averaged into one variable
  int max_gradients = 0;  // the most
  int takes = 0;          // variables taken (0: this engine has no trainable variable)
  bool forced = false;    // by the soft-sync step deadline
};

class StepCommit {
 public:
  virtual ~StepCommit() = default;
  // True: the engine commits a prepared step itself and releases its tokens.
  virtual bool commits_locally() const = 0;
  // commits_locally() false: step `p` is prepared; whoever decides calls CommitPrepared(p.step).
  // An engine with no trainable variable reports every step at once (ReportIfIdle).
  virtual void OnPrepared(const PreparedStep& p) = 0;
};

// A single daemon: every prepared step commits at once.
class LocalStepCommit final : public StepCommit {
 public:
  bool commits_locally() const override { return true; }
  void OnPrepared(const PreparedStep&) override {}
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_STEP_COMMIT_H_
