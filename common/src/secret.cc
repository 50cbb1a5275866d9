#include "psd/secret.h"

#include <cctype>
#include <fstream>
#include <iterator>

namespace psd {

Result<std::string> ReadSecretFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return InvalidArgument("cannot read the secret file " + path);
  std::string token((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  if (token.empty()) return InvalidArgument("the secret file " + path + " is empty");
  return token;
}

bool SecretsEqual(std::string_view want, std::string_view got) {
  unsigned char diff = want.size() == got.size() ? 0 : 1;
  for (size_t i = 0; i < want.size(); ++i) {
    diff |= static_cast<unsigned char>(want[i] ^ (i < got.size() ? got[i] : 0));
  }
  return diff == 0;
}

}  // namespace psd
