#include "daemon/checkpoint_writer.h"

namespace psd::server {

void CheckpointWriter::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
}

void CheckpointWriter::Queue(ShardSnapshot snap) {
  MutexLock lock(&mu_);
  pending_ = std::move(snap);
  cv_.NotifyOne();
}

bool CheckpointWriter::Busy() const {
  MutexLock lock(&mu_);
  return writing_ || pending_.has_value();
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
    MutexLock lock(&mu_);
    writing_ = false;
  }
}

}  // namespace psd::server
