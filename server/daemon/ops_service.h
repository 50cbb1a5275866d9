// OpsService: psd's operator endpoints on --metrics-host:--metrics-port (HTTP):
//
//   /metrics      Prometheus text format (psd_* and process_* families; see README "Monitoring")
//   /status.json  the job at a glance, as JSON (what the status page draws)
//   /             the live status page (self-contained HTML + JS, no CDN)
//   /healthz      200 "ok" while the daemon's event loop answers (liveness)
//   /readyz       200 "ready" once restored, formed and serving workers; 503 + the reason otherwise
//
// With --auth-token-file, everything but /healthz and /readyz needs the token:
// `Authorization: Bearer <token>`, or HTTP Basic auth with the token as the password (what a browser
// asks for). The probes reveal nothing but ok/ready and why not.
//
// It also samples the global step once a second for the step-rate history. Threading: the
// handler runs on the server's I/O threads and only reads thread-safe state (engine stats, the
// registry, the coordinator's view, Metrics).
#ifndef PSD_SERVER_DAEMON_OPS_SERVICE_H_
#define PSD_SERVER_DAEMON_OPS_SERVICE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "cluster/placement.h"
#include "ops/http_server.h"
#include "ops/text_format.h"
#include "psd/status.h"
#include "wire/asio.h"

namespace psd::server {
class Server;
}

namespace psd::server::ops {

class OpsService {
 public:
  OpsService(Server& server, asio::io_context& io);
  ~OpsService();

  // Listens when --metrics-port >= 0 (writing --metrics-port-file) and starts the sampler.
  Status Start();
  void Stop();
  // The bound metrics port (0 when off).
  uint16_t port() const { return http_ ? http_->port() : 0; }

  HttpResponse Handle(const HttpRequest& req);
  // Prometheus text: this daemon's figures (labelled shard="i"), a stand-in's it runs (labelled
  // with the shard it serves and stand_in="true"), then the process's.
  std::string RenderMetrics() const;
  std::string RenderStatusJson() const;

 private:
  // One daemon's figures (not the process's).
  static void WriteDaemonMetrics(PrometheusWriter& w, Server& server);
  bool Authorized(const HttpRequest& req) const;
  void ScheduleSample();

  // The status page's placement listing (at most kMaxListed variables), taken anew when the engine
  // or its variable count changed, or after kPlacementMaxAge: the page asks every second, and the
  // whole map is copied under the coordinator's (or the engine's) lock to take it.
  struct PlacementListing {
    const void* engine = nullptr;
    int64_t variables = -1;
    std::chrono::steady_clock::time_point at;
    bool whole = false;
    bool truncated = false;
    std::vector<VarPlacement> listed;
    std::vector<uint64_t> shard_bytes;
  };
  static constexpr size_t kMaxListed = 1000;  // a page, not a dump: psd_admin placement has them all
  static constexpr std::chrono::seconds kPlacementMaxAge{10};
  PlacementListing Placement(const void* engine, int64_t variables) const EXCLUDES(placement_mu_);

  Server& server_;
  asio::io_context& io_;
  asio::steady_timer sample_timer_;
  std::unique_ptr<HttpServer> http_;
  mutable Mutex placement_mu_;
  mutable PlacementListing placement_ GUARDED_BY(placement_mu_);
};

// Decodes standard base64 (padding optional); nullopt-like empty result with ok=false on bad input.
bool Base64Decode(std::string_view in, std::string* out);

}  // namespace psd::server::ops

#endif  // PSD_SERVER_DAEMON_OPS_SERVICE_H_
