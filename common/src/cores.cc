#include "psd/cores.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <thread>

namespace psd {
namespace {

// cgroup v2: "max 100000" (no quota) or "200000 100000" (2 cores); the process's own cgroup is
// mounted at /sys/fs/cgroup in a container and under systemd's unified hierarchy. 0: no quota.
int CgroupQuotaCores() {
  {
    std::ifstream in("/sys/fs/cgroup/cpu.max");
    std::string quota;
    double period = 0;
    if (in >> quota >> period) {
      if (quota == "max" || period <= 0) return 0;
      double q = std::strtod(quota.c_str(), nullptr);
      return q > 0 ? static_cast<int>(std::ceil(q / period)) : 0;
    }
  }
  std::ifstream quota_in("/sys/fs/cgroup/cpu/cpu.cfs_quota_us");
  std::ifstream period_in("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
  double quota = 0, period = 0;
  if (!(quota_in >> quota) || !(period_in >> period) || quota <= 0 || period <= 0) return 0;  // -1: none
  return static_cast<int>(std::ceil(quota / period));
}

}  // namespace

int UsableCores() {
  int cores = 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = static_cast<int>(std::thread::hardware_concurrency());
  int quota = CgroupQuotaCores();
  if (quota > 0) cores = cores > 0 ? std::min(cores, quota) : quota;
  return std::max(1, cores);
}

int ThreadsOrCores(int requested) { return requested > 0 ? requested : UsableCores(); }

}  // namespace psd
