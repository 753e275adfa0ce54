// The other process of the sharing tests: receives a handle on its socket
// (fd 3), imports it, checks the bytes the parent wrote, overwrites them and
// answers "ok" or what went wrong.
//
//   shoal_test_share_peer <host|cuda> <bytes> <expected byte> <byte to write>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "shoal/backend/devices.h"
#include "shoal/core/error.h"
#include "shoal/core/child_process.h"
#include "support/fd_transport.h"

namespace {

using namespace shoal;

std::string check_and_overwrite(backend::device& dev, std::size_t bytes, std::uint8_t expected, std::uint8_t write) {
  const int socket = child_process::child_socket_fd;
  testing::message m = testing::receive_message(socket, 4096);
  const auto handle = backend::shareable_handle::deserialize(m.payload, std::move(m.fd));
  void* p = dev.import_memory(handle);
  std::vector<std::uint8_t> seen(bytes);
  dev.copy({}, seen.data(), p, bytes);
  dev.synchronize({});
  for (std::size_t i = 0; i < bytes; ++i) {
    if (seen[i] != expected) {
      dev.close_import(p);
      return "byte " + std::to_string(i) + " is " + std::to_string(seen[i]) + ", expected " + std::to_string(expected);
    }
  }
  dev.fill({}, p, write, bytes);
  dev.synchronize({});
  dev.close_import(p);
  try {
    dev.close_import(p);
    return "closing an import twice was accepted";
  } catch (const invalid_argument&) {
  }
  return "ok";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s <host|cuda> <bytes> <expected byte> <byte to write>\n", argv[0]);
    return 2;
  }
  std::string answer;
  try {
    const std::string backend_name = argv[1];
    backend::device& dev = backend_name == "cuda" ? backend::cuda_device_instance(0) : backend::host_device_instance();
    answer = check_and_overwrite(dev, std::strtoull(argv[2], nullptr, 10), static_cast<std::uint8_t>(std::atoi(argv[3])),
                                 static_cast<std::uint8_t>(std::atoi(argv[4])));
  } catch (const std::exception& e) {
    answer = std::string("peer failed: ") + e.what();
  }
  try {
    testing::send_message(child_process::child_socket_fd, std::as_bytes(std::span(answer)));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "peer could not answer: %s\n", e.what());
    return 1;
  }
  return answer == "ok" ? 0 : 1;
}
