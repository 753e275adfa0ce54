// One fuzz input run end to end: a fresh consumer-side peer receives what the
// hostile program writes into a fresh connection, on this process's sharing
// context. A writer thread writes while the consumer reads, so no input can
// fill the socket and stall itself. Every storage received is checked and
// touched (storage_check.h); then every wait on the program's event page is
// passed, the storages dropped and the peer closed.
//
// Whatever the bytes, receiving must end in protocol_error or
// connection_closed; anything else thrown aborts the run, naming it.
//
// Thread-safety: one call at a time (one process-wide receiver context).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace shoal::fuzz {

struct receive_outcome {
  std::size_t storages = 0;  ///< storages built, checked and touched
  std::size_t notes = 0;
  std::string end;  ///< "closed", or the protocol_error's message
};

receive_outcome receive_program(std::span<const std::uint8_t> input);

}  // namespace shoal::fuzz
