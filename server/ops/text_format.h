// Prometheus' text exposition format (version 0.0.4), appended to a std::string. (JSON is written
// with text/json.h.)
//
// Why our own and not prometheus-cpp: Debian 12 has no prometheus-cpp package, its exposer brings
// a second HTTP server (civetweb) that could not also serve the status page, /healthz and /readyz
// on one port under psd's own auth and connection limits, and the format is ~100 lines.
#ifndef PSD_SERVER_OPS_TEXT_FORMAT_H_
#define PSD_SERVER_OPS_TEXT_FORMAT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ops/metrics.h"

namespace psd::server::ops {

using Labels = std::vector<std::pair<std::string, std::string>>;

class PrometheusWriter {
 public:
  // `common` labels (e.g. shard="1") are added to every sample.
  explicit PrometheusWriter(Labels common = {}) : common_(std::move(common)) {}
  // The common labels of the samples written from now on (a second daemon's figures, e.g. a
  // stand-in's, in the same exposition).
  void SetCommon(Labels common) { common_ = std::move(common); }

  // Each family's HELP/TYPE header is written once, by the first sample of that name; a family's
  // samples stay together (the format asks it) whenever they are written.
  void Gauge(std::string_view name, std::string_view help, double value, const Labels& labels = {});
  void Counter(std::string_view name, std::string_view help, double value, const Labels& labels = {});
  void Histo(std::string_view name, std::string_view help, const Histogram::Snapshot& h, const Labels& labels = {});

  // The families in the order they were first written.
  std::string text() const;

 private:
  // Selects the family `name` (declared on its first sample) for the samples that follow.
  void Header(std::string_view name, std::string_view help, std::string_view type);
  void Sample(std::string_view name, const Labels& labels, double value, const char* extra_key = nullptr,
              const std::string& extra_value = {});

  Labels common_;
  std::vector<std::pair<std::string, std::string>> families_;  // name, its header and samples
  std::string* out_ = nullptr;                                 // the selected family's text
};

// Label values escape \, " and newline (the exposition format's rules).
std::string EscapeLabelValue(std::string_view v);
// Prometheus floats: integers without a decimal point, +Inf/-Inf/NaN spelled its way.
std::string FormatNumber(double v);

}  // namespace psd::server::ops

#endif  // PSD_SERVER_OPS_TEXT_FORMAT_H_
