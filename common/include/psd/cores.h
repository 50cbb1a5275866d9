// The cores this process may use, for thread counts that default to "one per core".
#ifndef PSD_CORES_H_
#define PSD_CORES_H_

namespace psd {

// The CPUs this process may run on (its affinity mask: taskset, cpusets), further bounded by a
// cgroup CPU quota (cgroup v2 cpu.max, or v1 cpu.cfs_quota_us / cpu.cfs_period_us, rounded up):
// what a container or a systemd CPUQuota= gives it, not the machine's core count. At least 1.
int UsableCores();

// `requested` when positive, else UsableCores(): how a thread-count flag's 0 ("one per core")
// resolves.
int ThreadsOrCores(int requested);

}  // namespace psd

#endif  // PSD_CORES_H_
