#include "daemon/checkpoint_writer.h"

namespace psd::server {

void CheckpointWriter::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
}

void CheckpointWriter::Queue(ShardSnapshot snap) {
  MutexLock lock(&mu_);
  pending_ = std::move(snap);
  deferred_ = false;  // taken after a deferred request came: it answers it
  cv_.NotifyOne();
}

bool CheckpointWriter::Busy() const {
  MutexLock lock(&mu_);
  return writing_ || pending_.has_value();
}

bool CheckpointWriter::Defer() {
  MutexLock lock(&mu_);
  if (!writing_ && !pending_.has_value()) return false;
  deferred_ = true;
  return true;
}

void CheckpointWriter::Stop() {
  if (!thread_.joinable()) return;
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.NotifyOne();
  thread_.join();  // finishes a pending write first
}

void CheckpointWriter::Loop() {
  for (;;) {
    std::optional<ShardSnapshot> snap;
    {
      MutexLock lock(&mu_);
      while (!stop_ && !pending_.has_value()) cv_.Wait(&mu_);
      if (!pending_) return;
      snap = std::move(pending_);
      pending_.reset();
      writing_ = true;
    }
    write_(*snap);
    bool again = false;
    {
      MutexLock lock(&mu_);
      writing_ = false;
      // A request still deferred (no snapshot queued since it came) is asked for now; one queued
      // before it is written first, and the request after that.
      again = deferred_ && !pending_.has_value() && !stop_;
      if (again) deferred_ = false;
    }
    if (again && again_) again_();
  }
}

}  // namespace psd::server
