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

}  // namespace psd
