// The lending protocol's fuzz target: one input run end to end. Its first
// byte picks what is attacked (modulo 3):
//   0 the decoders: the rest is one payload given to every decoder of
//     src/lending/messages.cpp (and the chunk's handle decoder); each decodes
//     it or throws protocol_error, and what decodes encodes back to the same
//     bytes.
//   1 the lender: a fresh in-process lender (host backend; a capacity of
//     64 MiB, quotas per connection, per uid and of regions) serves one
//     connection, into which a hostile borrower writes the rest, read as a
//     lending_program, while a reader drains the answers. Then it hangs up:
//     within 2 s the lender must have let the connection go, and its status
//     must add up (lent bytes are its regions' bytes, within the capacity and
//     the quotas; every region of the hung-up borrower orphaned, since its
//     process still runs).
//   2 the borrower: a hostile lender writes the rest (a lending_program) into
//     a borrower's connection, then ends it; the second byte is the
//     borrower's script (4 calls of 2 bits: borrow, revocations, metrics,
//     give_back). Every region it borrows must lie in memory the hostile
//     lender sent, and is read and written whole (storage_check.h); every
//     call must return or throw a shoal::error.
// Anything else ends the run in abort(), naming what happened.
//
// Thread-safety: one call at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace shoal::fuzz {

struct lending_outcome {
  /// Messages decoded; regions the lender lent; regions the borrower mapped and touched.
  std::size_t regions = 0;
  /// The lender: "closed", or why it closed the connection. The borrower: the
  /// first error a call threw, or "done".
  std::string end;
};

lending_outcome run_lending_input(std::span<const std::uint8_t> input);

}  // namespace shoal::fuzz
