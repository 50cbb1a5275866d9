// systemd's socket activation protocol (sd_listen_fds(3)) without libsystemd: with a .socket
// unit, systemd binds the port, starts psd with the listening socket as descriptor 3 and says so
// in $LISTEN_PID and $LISTEN_FDS (main() reads them — systemd's contract, like $NOTIFY_SOCKET; the
// daemon reads no other environment).
#ifndef PSD_SERVER_OPS_SD_LISTEN_H_
#define PSD_SERVER_OPS_SD_LISTEN_H_

#include "psd/status.h"

namespace psd::server::ops {

// The first descriptor systemd passes (SD_LISTEN_FDS_START).
inline constexpr int kSdListenFdsStart = 3;

// The socket systemd passed to process `self_pid`, given the values of $LISTEN_PID and
// $LISTEN_FDS (null: unset). -1 when none was passed to this process (a variable unset, or
// LISTEN_PID naming another process, as sd_listen_fds does). psd serves one socket (its data
// port): more than one is an error saying to list a single ListenStream=; so is a malformed value.
Result<int> SdListenFd(const char* listen_pid, const char* listen_fds, long self_pid);

}  // namespace psd::server::ops

#endif  // PSD_SERVER_OPS_SD_LISTEN_H_
