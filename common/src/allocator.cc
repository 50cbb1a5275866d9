#include "psd/allocator.h"

#include <cstdlib>
#include <initializer_list>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace psd {

void TuneAllocator() {
#if defined(__GLIBC__)
  for (const char* var : {"GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}) {
    if (std::getenv(var) != nullptr) return;  // the operator's choice
  }
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
}

}  // namespace psd
