// What the fuzz target does with every storage a hostile producer got built:
// checks that all of its bytes lie in memory of files the producer sent (by
// /proc/self/maps: each byte in a shared read-write mapping of one of those
// files), then
// reads and writes every byte. A storage reaching past what was mapped thus
// ends the run: in memory of this process that is not the peer's, the check
// fails (abort, with the range); in no mapping at all, the touch faults.
//
// Thread-safety: any thread; reads /proc/self/maps each call.
#pragma once

#include <cstddef>

#include "fuzz/descriptor_kit.h"

namespace shoal::fuzz {

/// Aborts, naming the range, unless [data, data + bytes) lies wholly in
/// writable shared mappings of files `kit` sent as memory (may_hold_storage);
/// then reads and writes every byte.
void check_and_touch(void *data, std::size_t bytes, const descriptor_kit &kit);

}  // namespace shoal::fuzz
