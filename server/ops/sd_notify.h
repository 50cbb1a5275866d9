// systemd's readiness protocol (sd_notify(3)) without libsystemd: one datagram to the Unix socket
// systemd names in $NOTIFY_SOCKET (main() reads the variable; the daemon reads no environment).
// A path starting with '@' is in the abstract namespace. With `Type=notify`, systemd considers psd
// started only once it sends "READY=1".
#ifndef PSD_SERVER_OPS_SD_NOTIFY_H_
#define PSD_SERVER_OPS_SD_NOTIFY_H_

#include <string>

#include "psd/status.h"

namespace psd::server::ops {

// Sends `state` (e.g. "READY=1\nSTATUS=serving") to `socket_path`. An empty path is a no-op (not
// started by systemd). Errors say why the datagram could not be sent.
Status SdNotify(const std::string& socket_path, const std::string& state);

}  // namespace psd::server::ops

#endif  // PSD_SERVER_OPS_SD_NOTIFY_H_
