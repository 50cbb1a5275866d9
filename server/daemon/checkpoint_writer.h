// CheckpointWriter: the daemon's background checkpoint writer. The engine hands over a snapshot
// (values shared, slots copied) and goes on training; one thread writes it with `write` (the
// daemon's: checkpoint files, metrics, the cluster's part report). A snapshot queued while another
// is being written waits; a newer one replaces a queued one not yet started.
//
// Thread-safety: Queue and Busy from any thread; Start and Stop from the daemon's owner thread.
#ifndef PSD_SERVER_DAEMON_CHECKPOINT_WRITER_H_
#define PSD_SERVER_DAEMON_CHECKPOINT_WRITER_H_

#include <functional>
#include <optional>
#include <thread>

#include "base/mutex.h"
#include "core/snapshot.h"

namespace psd::server {

class CheckpointWriter {
 public:
  using WriteFn = std::function<void(const ShardSnapshot&)>;
  explicit CheckpointWriter(WriteFn write) : write_(std::move(write)) {}
  ~CheckpointWriter() { Stop(); }
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Starts the writer thread (once).
  void Start();
  bool started() const { return thread_.joinable(); }
  void Queue(ShardSnapshot snap) EXCLUDES(mu_);
  // A write in progress or queued.
  bool Busy() const EXCLUDES(mu_);
  // Writes what is in progress and queued, then ends the thread. Idempotent.
  void Stop() EXCLUDES(mu_);

 private:
  void Loop() EXCLUDES(mu_);

  const WriteFn write_;
  std::thread thread_;
  mutable Mutex mu_;
  CondVar cv_;
  std::optional<ShardSnapshot> pending_ GUARDED_BY(mu_);
  bool writing_ GUARDED_BY(mu_) = false;
  bool stop_ GUARDED_BY(mu_) = false;
};

}  // namespace psd::server

#endif  // PSD_SERVER_DAEMON_CHECKPOINT_WRITER_H_
