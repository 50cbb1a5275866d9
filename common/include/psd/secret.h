// Reading the shared secret of --auth-token-file (psd) and of the tools and trainers that
// connect to it.
#ifndef PSD_SECRET_H_
#define PSD_SECRET_H_

#include <string>

#include "psd/status.h"

namespace psd {

// The file's contents without trailing whitespace; an error if it is unreadable or empty.
Result<std::string> ReadSecretFile(const std::string& path);

}  // namespace psd

#endif  // PSD_SECRET_H_
