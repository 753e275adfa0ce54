// A fuzz target for the receiving side of sharing: the input is read as a
// series of frames, { type u8, descriptor u8, length u16, payload }, written
// raw into a connection whose other end a peer receives on. Whatever the
// bytes, receive must end in a storage, a note, protocol_error or
// connection_closed, and must not crash or leak.
//
// Built two ways: with clang's libFuzzer (-DSHOAL_BUILD_FUZZERS=ON), and as
// a ctest program that feeds it seeded random inputs (message_fuzz_driver.cpp).
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/core/error.h"
#include "shoal/channel/channel.h"
#include "shoal/ipc/sharing.h"

namespace {

using namespace shoal;

struct receiver_world {
  alloc::caching_allocator allocator{backend::host_device_instance(), {}};
  ipc::sharing_context context{allocator, {.collect_interval = std::chrono::milliseconds(0), .receive_spin = {}}};
};

receiver_world& world() {
  static receiver_world w;
  return w;
}

unique_fd some_memfd() {
  unique_fd fd(::memfd_create("shoal-fuzz", MFD_CLOEXEC));
  if (fd) (void)::ftruncate(fd.get(), 2 << 20);
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return 0;
  channel::connection writer = channel::connection::adopt(unique_fd(fds[0]), {});
  const unique_fd memfd = some_memfd();
  // Frames go out first (a socket buffer holds far more than 64 KiB of input),
  // after the protocol hello, so the input reaches the sharing messages.
  writer.send(channel::hello_frame_type, channel::encode_hello(ipc::sharing_protocol));
  std::size_t at = 0;
  while (at + 4 <= size && at < 60000) {
    const std::uint8_t type = data[at] % 10;
    const bool with_fd = (data[at + 1] & 1) != 0;
    std::size_t length = data[at + 2] | (std::size_t{data[at + 3]} << 8);
    at += 4;
    length = std::min(length, size - at);
    writer.send(type, std::span(reinterpret_cast<const std::byte*>(data + at), length), with_fd ? memfd.get() : -1);
    at += length;
  }
  { auto closing = std::move(writer); }
  {
    ipc::peer receiver(world().context, channel::connection::adopt(unique_fd(fds[1]), {}));
    try {
      for (;;) (void)receiver.receive(backend::stream_ref{});
    } catch (const protocol_error&) {
    } catch (const connection_closed&) {
    }
  }
  return 0;
}
