#include "fuzz/lending_target.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "fuzz/lending_program.h"
#include "fuzz/storage_check.h"
#include "lending/messages.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/shareable_handle.h"
#include "shoal/core/error.h"
#include "shoal/lending/borrower.h"
#include "shoal/lending/lender.h"

namespace shoal::fuzz {

namespace {

using namespace std::chrono_literals;
constexpr std::size_t mib = std::size_t{1} << 20;
constexpr std::size_t capacity = 64 * mib, quota = 32 * mib, quota_per_uid = 12 * mib, max_regions = 8;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "shoal lending fuzz: %s\n", what.c_str());
  std::abort();
}

// A fresh abstract address for each run's listener.
channel::channel_address fresh_address(const char* role) {
  static unsigned serial = 0;
  return channel::channel_address::abstract("shoal-fuzz-" + std::string(role) + "-" + std::to_string(::getpid()) +
                                            "-" + std::to_string(serial++));
}

// Does what the hostile peer does on `link`, until the end or the connection fails.
void act(channel::connection& link, const std::vector<peer_action>& actions) {
  try {
    for (const peer_action& a : actions) {
      if (!a.raw) {
        link.send(a.type, a.bytes, a.fd);
        continue;
      }
      std::size_t sent = 0;
      while (sent < a.bytes.size()) {
        const ssize_t n = ::send(link.native_handle(), a.bytes.data() + sent, a.bytes.size() - sent, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        sent += static_cast<std::size_t>(n);
      }
    }
  } catch (const error&) {  // NOLINT(bugprone-empty-catch): the other side hung up on what it was sent
  }
}

// Reads and drops what arrives on `socket` until it ends, or nothing came
// for `quiet` (descriptors that come along are closed by the kernel).
void drain(int socket, std::chrono::milliseconds quiet) {
  const timeval limit{quiet.count() / 1000, static_cast<suseconds_t>(quiet.count() % 1000 * 1000)};
  ::setsockopt(socket, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  char buffer[65536];
  while (::recv(socket, buffer, sizeof buffer, 0) > 0) {
  }
}

template <class Decode, class Encode>
void round_trip(std::span<const std::byte> payload, const char* name, std::size_t& decoded, Decode decode,
                Encode encode) {
  try {
    const auto message = decode(payload);
    const std::vector<std::byte> again = encode(message);
    if (!std::equal(again.begin(), again.end(), payload.begin(), payload.end())) {
      fail(std::string(name) + ": what decoded does not encode back to the same " + std::to_string(payload.size()) +
           " bytes");
    }
    ++decoded;
  } catch (const protocol_error&) {  // NOLINT(bugprone-empty-catch): refused is what hostile bytes get
  }
}

lending_outcome attack_decoders(std::span<const std::uint8_t> input) {
  namespace d = lending::detail;
  const auto payload = std::as_bytes(input);
  std::size_t decoded = 0;
  const auto same = [](const auto& m) { return d::encode(m); };
  round_trip(payload, "borrow", decoded, d::decode_borrow, same);
  round_trip(payload, "lent", decoded, d::decode_lent, same);
  round_trip(payload, "refused", decoded, d::decode_refused, same);
  round_trip(payload, "revoke", decoded, d::decode_revoke, same);
  round_trip(payload, "publish", decoded, d::decode_publish, same);
  round_trip(payload, "borrow_shared", decoded, d::decode_borrow_shared, same);
  round_trip(payload, "layout", decoded, d::decode_layout, same);
  round_trip(payload, "give_back", decoded, d::decode_give_back, same);
  round_trip(payload, "given_back", decoded, d::decode_given_back, same);
  round_trip(payload, "forget", decoded, d::decode_forget, d::encode_forget);
  round_trip(payload, "revoke_request", decoded, d::decode_revoke_request, same);
  round_trip(payload, "revoke_accepted", decoded, d::decode_revoke_accepted, d::encode_revoke_accepted);
  round_trip(payload, "cancel_wait", decoded, d::decode_cancel_wait, d::encode_cancel_wait);
  round_trip(
      payload, "chunk", decoded, [](auto p) { return backend::shareable_handle::deserialize(p, unique_fd()); },
      [](const backend::shareable_handle& h) { return h.serialize(); });
  return {decoded, "decoded"};
}

// Checks that the lender's books add up once its hostile borrower is gone.
void check_books(const lending::lender_status& s) {
  std::size_t bytes = 0;
  for (const auto& r : s.regions) {
    bytes += r.bytes;
    if (r.state != lending::region_state::orphaned) {
      fail("region " + std::to_string(r.id) + " of a borrower that hung up is not orphaned");
    }
  }
  if (bytes != s.lent_bytes) {
    fail("lent_bytes " + std::to_string(s.lent_bytes) + ", its regions hold " + std::to_string(bytes));
  }
  if (bytes > capacity || bytes > quota || bytes > quota_per_uid || s.regions.size() > max_regions) {
    fail(std::to_string(s.regions.size()) + " regions of " + std::to_string(bytes) +
         " bytes lent to one borrower: past the capacity or a quota");
  }
}

lending_outcome attack_lender(std::span<const std::uint8_t> input) {
  const lending_program program(input);
  std::mutex guard;
  lending_outcome outcome{0, "closed"};
  bool closed_for_error = false;
  lending::lender_config config{.capacity_bytes = capacity,
                                .quota_bytes = quota,
                                .quota_bytes_per_uid = quota_per_uid,
                                .max_borrowers = 4,
                                .max_regions_per_borrower = max_regions,
                                .peer_timeout = 100ms};
  config.on_event = [&](const lending::lender_event& e) {
    const std::lock_guard lock(guard);
    if (e.what == lending::lender_event::kind::lent) ++outcome.regions;
    if (e.what == lending::lender_event::kind::closed_for_error && !closed_for_error) {
      closed_for_error = true;
      outcome.end = e.detail;
    }
  };
  const lending::lender lender(backend::host_device_instance(), fresh_address("lender"), config);
  {
    auto link = channel::connection::connect(lender.address(), {});
    link.set_send_timeout(200ms);
    // Answers are read while the program is written, and after it until the
    // lender hangs up, having served every frame up to the end of the stream.
    std::thread reader(drain, link.native_handle(), 2000ms);
    act(link, program.actions());
    ::shutdown(link.native_handle(), SHUT_WR);
    reader.join();
  }
  const auto until = std::chrono::steady_clock::now() + 2s;
  for (;;) {
    {
      const std::lock_guard lock(guard);
      // A connection that never said hello never connected: no event, only the count.
      if (lender.status().connections == 0) break;
    }
    if (std::chrono::steady_clock::now() > until) fail("the lender kept a borrower that hung up 2 s ago");
    std::this_thread::sleep_for(1ms);
  }
  check_books(lender.status());
  const std::lock_guard lock(guard);
  return outcome;
}

lending_outcome attack_borrower(std::uint8_t script, std::span<const std::uint8_t> input) {
  lending_program program(input);
  const auto address = fresh_address("borrower");
  channel::listener listener(address, {});
  std::thread hostile([&] {
    try {
      auto link = listener.accept_for(2000ms);
      if (!link) return;
      link->set_send_timeout(200ms);
      act(*link, program.actions());
      ::shutdown(link->native_handle(), SHUT_WR);
      drain(link->native_handle(), 5000ms);  // until the borrower hangs up
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): the borrower hung up first
    }
  });
  lending_outcome outcome{0, ""};
  const auto note = [&](const error& e) {
    if (outcome.end.empty()) outcome.end = e.what();
  };
  auto& device = backend::host_device_instance();
  try {
    lending::borrower b(device, address, {}, 1000ms);
    std::vector<lending::borrowed_region> held;
    for (int step = 0; step < 4; ++step) {
      try {
        switch ((script >> (2 * step)) & 3) {
          case 0: {
            auto region = b.borrow(step % 2 == 0 ? 2 * mib : 1, "fuzz", lending::region_mode::exclusive, 1000ms);
            check_and_touch(region.data(), region.size(), program.kit());
            ++outcome.regions;
            held.push_back(std::move(region));
            break;
          }
          case 1:
            (void)b.revocations(1000ms);
            break;
          case 2:
            (void)b.metrics(1000ms);
            break;
          default:
            if (held.empty()) break;
            b.give_back(std::move(held.back()), 1000ms);
            held.pop_back();
        }
      } catch (const error& e) {
        note(e);
      }
    }
    held.clear();  // given back, or dropped where the lender is gone: before the connection goes
  } catch (const error& e) {
    note(e);
  } catch (const std::exception& e) {
    fail(std::string("a borrower's call threw what is no shoal::error: ") + e.what());
  }
  hostile.join();
  if (outcome.end.empty()) outcome.end = "done";
  return outcome;
}

}  // namespace

lending_outcome run_lending_input(std::span<const std::uint8_t> input) {
  if (input.empty()) return {0, "empty"};
  switch (input[0] % 3) {
    case 0:
      return attack_decoders(input.subspan(1));
    case 1:
      return attack_lender(input.subspan(1));
    default:
      return attack_borrower(input.size() > 1 ? input[1] : 0, input.subspan(std::min<std::size_t>(2, input.size())));
  }
}

}  // namespace shoal::fuzz
