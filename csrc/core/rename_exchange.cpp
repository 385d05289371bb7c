#include "core/rename_exchange.h"

#include <cerrno>

#if defined(__linux__)
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace shardkit::core {

int rename_exchange(const char* a, const char* b) {
#if defined(__linux__) && defined(SYS_renameat2)
  constexpr unsigned int kRenameExchange = 1u << 1;  // RENAME_EXCHANGE of <linux/fs.h>, stable kernel ABI
  if (syscall(SYS_renameat2, AT_FDCWD, a, AT_FDCWD, b, kRenameExchange) == 0) return 0;
  return errno;
#else
  (void)a;
  (void)b;
  return ENOSYS;
#endif
}

}  // namespace shardkit::core
