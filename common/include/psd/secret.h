// Reading the shared secret of --auth-token-file (psd) and of the tools and trainers that
// connect to it.
#ifndef PSD_SECRET_H_
#define PSD_SECRET_H_

#include <string>
#include <string_view>

#include "psd/export.h"
#include "psd/status.h"

namespace psd {

// The file's contents without trailing whitespace; an error if it is unreadable or empty.
PSD_EXPORT Result<std::string> ReadSecretFile(const std::string& path);

// Compares secrets in time independent of where they differ (and of `got`'s contents).
PSD_EXPORT bool SecretsEqual(std::string_view want, std::string_view got);

}  // namespace psd

#endif  // PSD_SECRET_H_
