// The sharing protocol's fuzz target: each input is a hostile producer's
// program (hostile_program.h) received by a fresh consumer peer
// (receive_program.h).
//
// Built two ways: with clang's libFuzzer (-DSHOAL_BUILD_FUZZERS=ON, the
// whole library instrumented; scripts/fuzz), and as a ctest program that
// runs the seeds, the corpus and seeded random inputs
// (message_fuzz_driver.cpp).
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "fuzz/hostile_program.h"
#include "fuzz/receive_program.h"
#include "fuzz/storage_check.h"
#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/channel/channel.h"
#include "shoal/core/error.h"
#include "shoal/ipc/sharing.h"

namespace shoal::fuzz {

namespace {

struct receiver_world {
  alloc::caching_allocator allocator{backend::host_device_instance(), {}};
  ipc::sharing_context context{allocator, {.collect_interval = std::chrono::milliseconds(0), .receive_spin = {}}};
};

receiver_world &world() {
  static receiver_world w;
  return w;
}

// Writes every write of the program, then ends the stream; stops early when
// the consumer has shut the connection (a protocol error).
void write_all(int socket, const std::vector<socket_write> &writes) {
  for (const socket_write &w : writes) {
    iovec part{const_cast<std::byte *>(w.bytes.data()), w.bytes.size()};
    msghdr header{};
    header.msg_iov = &part;
    header.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(sizeof(int) * w.fds.size()));
    if (!w.fds.empty()) {
      header.msg_control = control.data();
      header.msg_controllen = control.size();
      cmsghdr *c = CMSG_FIRSTHDR(&header);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * w.fds.size());
      std::memcpy(CMSG_DATA(c), w.fds.data(), sizeof(int) * w.fds.size());
    }
    std::size_t sent = 0;
    while (sent < w.bytes.size()) {
      const ssize_t n = ::sendmsg(socket, &header, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      sent += static_cast<std::size_t>(n);
      part.iov_base = const_cast<std::byte *>(w.bytes.data()) + sent;
      part.iov_len = w.bytes.size() - sent;
      header.msg_control = nullptr;  // the descriptors went with the first part
      header.msg_controllen = 0;
    }
  }
  ::shutdown(socket, SHUT_WR);
}

[[noreturn]] void unexpected(const char *what) {
  std::fprintf(stderr,
               "shoal fuzz: receive ended in neither protocol_error nor "
               "connection_closed: %s\n",
               what);
  std::abort();
}

}  // namespace

receive_outcome receive_program(std::span<const std::uint8_t> input) {
  receive_outcome outcome;
  hostile_program program(input);
  int ends[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0) unexpected("no socketpair");
  const unique_fd producer_end(ends[0]);
  std::thread writer(write_all, producer_end.get(), std::cref(program.writes()));
  std::vector<storage::storage> held;
  {
    ipc::peer consumer(world().context, channel::connection::adopt(unique_fd(ends[1]), {}));
    try {
      for (;;) {
        ipc::received r = consumer.receive(backend::stream_ref{});
        if (!r.storage.valid()) {
          ++outcome.notes;
          continue;
        }
        check_and_touch(r.storage.mutable_data(), r.storage.size(), program.kit());
        ++outcome.storages;
        held.push_back(std::move(r.storage));  // held to the end: retirements meet storages in use
      }
    } catch (const protocol_error &e) {
      outcome.end = e.what();
    } catch (const connection_closed &) {
      outcome.end = "closed";
    } catch (const std::exception &e) {
      unexpected(e.what());
    }
    program.kit().pass_every_point();  // a hostile point waited for on the
                                       // receive stream passes now
    held.clear();
  }
  ::shutdown(producer_end.get(), SHUT_RDWR);
  writer.join();
  return outcome;
}

}  // namespace shoal::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  (void)shoal::fuzz::receive_program({data, size});
  return 0;
}
