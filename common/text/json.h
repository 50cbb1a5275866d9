// JsonWriter: a small streaming JSON writer shared by psd's status endpoint and psd_admin.
#ifndef PSD_TEXT_JSON_H_
#define PSD_TEXT_JSON_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace psd::text {

// A minimal streaming JSON writer: the caller nests Begin/End calls correctly; Key() before each
// member of an object. Strings are escaped (control characters as \u00XX); numbers that are not
// finite become null.
class JsonWriter {
 public:
  JsonWriter& BeginObject();
  JsonWriter& EndObject();
  JsonWriter& BeginArray();
  JsonWriter& EndArray();
  JsonWriter& Key(std::string_view k);
  JsonWriter& String(std::string_view v);
  JsonWriter& Number(double v);
  JsonWriter& Int(int64_t v);
  JsonWriter& Bool(bool v);
  JsonWriter& Null();
  const std::string& text() const { return out_; }

 private:
  void Comma();
  std::string out_;
  std::vector<bool> first_;  // per open container: no member written yet
  bool after_key_ = false;
};

std::string JsonEscape(std::string_view v);

}  // namespace psd::text

#endif  // PSD_TEXT_JSON_H_
