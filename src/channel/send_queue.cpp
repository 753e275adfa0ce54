#include "channel/send_queue.h"

#include <fcntl.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <string>

#include "shoal/core/error.h"

namespace shoal::channel::detail {

void send_queue::post(int socket, std::span<const std::byte> batch, std::span<const int> descriptors) {
  std::size_t written = 0;
  if (entries_.empty()) {
    written = write_ready(socket, batch, descriptors);
    if (written == batch.size()) return;
  }
  queue(batch, written, written > 0 ? std::span<const int>() : descriptors);
}

void send_queue::queue(std::span<const std::byte> batch, std::size_t written, std::span<const int> descriptors) {
  entry e;
  e.batch.assign(batch.begin() + static_cast<std::ptrdiff_t>(written), batch.end());
  for (const int fd : descriptors) {
    // Closed off the thread that drops it, as a peer's: the caller may have
    // posted one a peer passed and closed its own, leaving this copy the
    // last reference to what the peer queued on it.
    unique_fd copy = unique_fd::from_peer(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (!copy) throw os_error{errno, "fcntl(F_DUPFD_CLOEXEC)"};
    e.descriptors.push_back(std::move(copy));
  }
  e.posted = std::chrono::steady_clock::now();
  const std::size_t size = e.batch.size();
  entries_.push_back(std::move(e));  // counted once it is in: a failed push_back leaves bytes_ as it was
  bytes_ += size;
}

std::optional<std::chrono::steady_clock::time_point> send_queue::oldest_post() const noexcept {
  if (entries_.empty()) return std::nullopt;
  return entries_.front().posted;
}

void send_queue::flush(int socket) {
  while (!entries_.empty()) {
    entry& front = entries_.front();
    std::vector<int> descriptors;
    for (const unique_fd& fd : front.descriptors) descriptors.push_back(fd.get());
    const std::size_t sent = write_ready(socket, std::span(front.batch).subspan(front.written), descriptors);
    if (sent == 0) break;
    front.descriptors.clear();  // they went with the first byte
    front.written += sent;
    bytes_ -= sent;
    if (front.written == front.batch.size()) entries_.pop_front();
  }
}

bool send_queue::drain(int socket, deadline until) {
  for (;;) {
    flush(socket);
    if (entries_.empty()) return true;
    int timeout_ms = -1;
    if (until) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      timeout_ms = static_cast<int>(std::min<std::chrono::milliseconds::rep>(left.count(), INT_MAX));
    }
    pollfd waiting{socket, POLLOUT, 0};
    if (::poll(&waiting, 1, timeout_ms) < 0 && errno != EINTR) throw os_error{errno, "poll"};
  }
}

}  // namespace shoal::channel::detail
