// CheckpointWriter: the daemon's background checkpoint writer. The engine hands over a snapshot
// (values shared, slots copied) and goes on training; one thread writes it with `write` (the
// daemon's: checkpoint files, metrics, the cluster's part report). A snapshot queued while another
// is being written waits; a newer one replaces a queued one not yet started. An operator's request
// that comes while one is written or queued is deferred (Defer): `again` runs once the writer is
// idle, so a storm of requests costs one snapshot more, not one (a copy of every slot under the
// engine's lock) each.
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
  // `again`: asks for the snapshot a deferred request wanted (on the writer's thread, no lock held).
  explicit CheckpointWriter(WriteFn write, std::function<void()> again = nullptr)
      : write_(std::move(write)), again_(std::move(again)) {}
  ~CheckpointWriter() { Stop(); }
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Starts the writer thread (once).
  void Start();
  bool started() const { return thread_.joinable(); }
  void Queue(ShardSnapshot snap) EXCLUDES(mu_);
  // A write in progress or queued.
  bool Busy() const EXCLUDES(mu_);
  // When Busy: the request is remembered (once however many come) and `again` runs after the last
  // write; true. Otherwise false: the caller takes its snapshot now.
  bool Defer() EXCLUDES(mu_);
  // Writes what is in progress and queued, then ends the thread. Idempotent.
  void Stop() EXCLUDES(mu_);

 private:
  void Loop() EXCLUDES(mu_);

  const WriteFn write_;
  const std::function<void()> again_;
  std::thread thread_;
  mutable Mutex mu_;
  CondVar cv_;
  std::optional<ShardSnapshot> pending_ GUARDED_BY(mu_);
  bool writing_ GUARDED_BY(mu_) = false;
  bool deferred_ GUARDED_BY(mu_) = false;  // a request came while busy
  bool stop_ GUARDED_BY(mu_) = false;
};

}  // namespace psd::server

#endif  // PSD_SERVER_DAEMON_CHECKPOINT_WRITER_H_
