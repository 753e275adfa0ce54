#include "fuzz/storage_check.h"

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace shoal::fuzz {

namespace {

// Whether every byte of [begin, end) is in a read-write shared mapping of a
// file the kit sent as memory. /proc/self/maps lists mappings in address order.
bool in_sent_memory(std::uintptr_t begin, std::uintptr_t end, const descriptor_kit &kit) {
  std::FILE *maps = std::fopen("/proc/self/maps", "re");
  if (maps == nullptr) return false;
  std::uintptr_t covered = begin;
  char line[4096];
  while (covered < end && std::fgets(line, sizeof line, maps) != nullptr) {
    std::uintptr_t from = 0, to = 0;
    char perms[8] = {};
    unsigned long long offset = 0, inode = 0;
    char device[32] = {};
    if (std::sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %7s %llx %31s %llu", &from, &to, perms, &offset, device, &inode) !=
        6)
      continue;
    if (to <= covered) continue;
    if (from > covered) break;  // a gap
    if (std::strncmp(perms, "rw-s", 4) != 0 || !kit.may_hold_storage(static_cast<ino_t>(inode))) break;
    covered = to;
  }
  std::fclose(maps);
  return covered >= end;
}

}  // namespace

void check_and_touch(void *data, std::size_t bytes, const descriptor_kit &kit) {
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  if (!in_sent_memory(begin, begin + bytes, kit)) {
    std::fprintf(stderr,
                 "shoal fuzz: a received storage of %zu bytes at %p reaches "
                 "memory the peer did not send\n",
                 bytes, data);
    std::abort();
  }
  auto *p = static_cast<unsigned char *>(data);
  unsigned char sum = 0;
  for (std::size_t i = 0; i < bytes; ++i) sum = static_cast<unsigned char>(sum + p[i]);
  for (std::size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(sum + i);
}

}  // namespace shoal::fuzz
