// ServiceHost: what the wire service needs from the daemon that runs it (README "Architecture").
// The daemon (daemon/server.h) implements it; the service never sees the daemon itself, so the
// daemon can own the service without a cycle, and a test can host sessions on a fake.
//
// Thread-safety: every method may be called from any connection's strand concurrently.
#ifndef PSD_SERVER_SERVICE_SERVICE_HOST_H_
#define PSD_SERVER_SERVICE_SERVICE_HOST_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config/server_config.h"
#include "core/converted_values.h"
#include "core/ssp_gate.h"
#include "core/training_engine.h"
#include "core/var_placement.h"
#include "core/worker_registry.h"
#include "net/peer_auth.h"
#include "net/shm_listener.h"
#include "ops/metrics.h"
#include "psd/status.h"

namespace psd::server {

class ClusterCoordinator;

class ServiceHost {
 public:
  virtual ~ServiceHost() = default;

  virtual const ServerConfig& config() const = 0;
  // OK when workers are served now; else why not (UNAVAILABLE: restoring, cluster not formed).
  virtual Status Serving() const = 0;
  // The engine of the current epoch (replaced when a cluster forms again).
  virtual std::shared_ptr<TrainingEngine> engine() const = 0;
  // Null for a single daemon.
  virtual ClusterCoordinator* coordinator() = 0;
  virtual WorkerRegistry& workers() = 0;
  virtual SspGate& ssp() = 0;
  virtual ops::Metrics& metrics() = 0;
  // Where same-host workers attach shared memory; null with --no-shared-memory.
  virtual ShmListener* shm() = 0;
  virtual ConvertedValues& converted_values() = 0;
  virtual peer_auth::LogLimiter& spoof_log() = 0;
  virtual double uptime_s() const = 0;

  // A checkpoint at the next step boundary (cluster: forwarded to the chief).
  virtual Status RequestCheckpoint() = 0;
  virtual int64_t last_checkpoint_step() const = 0;
  // Every variable's placement and each shard's bytes (a single daemon: its own variables).
  virtual Status PlacementMap(std::vector<VarPlacement>* all, std::vector<uint64_t>* shard_bytes) const = 0;

  // A worker's hello on connection `conn`: its index, or why it is refused.
  virtual Result<uint32_t> OnHello(uint64_t conn, const std::string& name, uint64_t incarnation) = 0;
  virtual void OnWorkerFinished(uint64_t conn) = 0;
  virtual void OnConnectionClosed(uint64_t conn) = 0;
};

}  // namespace psd::server

#endif  // PSD_SERVER_SERVICE_SERVICE_HOST_H_
