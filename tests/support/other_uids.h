// Whether a test may act as other uids: switch a child to them
// (setresuid/setresgid) or give them files (chown). That needs root, and
// each uid mapped in this process's user namespace: a container that maps
// only root refuses 65534 with EINVAL, and such tests skip there rather
// than fail.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <fstream>
#include <initializer_list>

namespace shoal::testing {

namespace detail {

// Whether `id` lies in one of the ranges of `map_file` (/proc/self/uid_map
// or gid_map: "inside outside count" per line). No file: no namespaces,
// every id is there.
inline bool mapped_in(const char* map_file, unsigned long id) {
  std::ifstream map(map_file);
  if (!map) return true;
  unsigned long inside = 0, outside = 0, count = 0;
  while (map >> inside >> outside >> count) {
    if (id >= inside && id - inside < count) return true;
  }
  return false;
}

}  // namespace detail

/// Root, with each of `ids` mapped as a uid and as a gid (the tests' children
/// take the gid of the same number).
inline bool may_act_as(std::initializer_list<unsigned long> ids) {
  if (::geteuid() != 0) return false;
  for (const unsigned long id : ids) {
    if (!detail::mapped_in("/proc/self/uid_map", id) || !detail::mapped_in("/proc/self/gid_map", id)) return false;
  }
  return true;
}

}  // namespace shoal::testing
