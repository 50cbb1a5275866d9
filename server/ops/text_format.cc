#include "ops/text_format.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace psd::server::ops {

std::string EscapeLabelValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatNumber(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
  } else {
    std::snprintf(buf, sizeof(buf), "%.12g", v);
  }
  return buf;
}

void PrometheusWriter::Header(std::string_view name, std::string_view help, std::string_view type) {
  auto it = std::find_if(families_.begin(), families_.end(), [&](const auto& f) { return f.first == name; });
  if (it != families_.end()) {
    out_ = &it->second;
    return;
  }
  out_ = &families_.emplace_back(std::string(name), std::string()).second;
  std::string& out = *out_;
  out += "# HELP ";
  out += name;
  out += ' ';
  // HELP text escapes \ and newline.
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  out += "\n# TYPE ";
  out += name;
  out += ' ';
  out += type;
  out += '\n';
}

std::string PrometheusWriter::text() const {
  std::string all;
  for (const auto& [name, text] : families_) all += text;
  return all;
}

void PrometheusWriter::Sample(std::string_view name, const Labels& labels, double value, const char* extra_key,
                              const std::string& extra_value) {
  std::string& out = *out_;
  out += name;
  bool any = false;
  auto add = [&](std::string_view k, std::string_view v) {
    out += any ? ',' : '{';
    any = true;
    out += k;
    out += "=\"";
    out += EscapeLabelValue(v);
    out += '"';
  };
  for (const auto& [k, v] : common_) add(k, v);
  for (const auto& [k, v] : labels) add(k, v);
  if (extra_key) add(extra_key, extra_value);
  if (any) out += '}';
  out += ' ';
  out += FormatNumber(value);
  out += '\n';
}

void PrometheusWriter::Gauge(std::string_view name, std::string_view help, double value, const Labels& labels) {
  Header(name, help, "gauge");
  Sample(name, labels, value);
}

void PrometheusWriter::Counter(std::string_view name, std::string_view help, double value, const Labels& labels) {
  Header(name, help, "counter");
  Sample(name, labels, value);
}

void PrometheusWriter::Histo(std::string_view name, std::string_view help, const Histogram::Snapshot& h,
                             const Labels& labels) {
  Header(name, help, "histogram");
  std::string bucket = std::string(name) + "_bucket";
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    Sample(bucket, labels, static_cast<double>(h.cumulative[i]), "le", FormatNumber(h.bounds[i]));
  }
  Sample(bucket, labels, static_cast<double>(h.count), "le", "+Inf");
  Sample(std::string(name) + "_sum", labels, h.sum);
  Sample(std::string(name) + "_count", labels, static_cast<double>(h.count));
}

}  // namespace psd::server::ops
