// What the lending tests share: a lender per test on the backend under
// test, borrower processes (borrower_process.cpp) that talk back a line at a
// time, polling with a deadline, and an event recorder.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shoal/backend/host_device.h"
#include "shoal/core/child_process.h"
#include "shoal/lending/borrower.h"
#include "shoal/lending/lender.h"
#include "shoal/lending/lender_test_hook.h"
#include "support/backends.h"
#include "support/processes.h"

namespace shoal::testing {

using namespace std::chrono_literals;
using lending::borrower;
using lending::lender;
using lending::lender_config;

inline constexpr std::size_t mib = std::size_t{1} << 20;

/// Clears the publish hook when the test ends, however it ends.
struct publish_hook {
  explicit publish_hook(std::function<void(std::uint64_t)> hook) {
    lending::test_hook::set_before_publish_commits(std::move(hook));
  }
  ~publish_hook() { lending::test_hook::set_before_publish_commits({}); }
  publish_hook(const publish_hook&) = delete;
  publish_hook& operator=(const publish_hook&) = delete;
};

/// Polls `done` until it holds or `limit` passes.
template <class Done>
bool eventually(Done done, std::chrono::milliseconds limit = 5000ms) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

/// A line the child process wrote on its socket.
inline std::string line_from(const child_process& child) {
  std::string line;
  char c;
  while (::read(child.socket(), &c, 1) == 1 && c != '\n') line += c;
  return line;
}

/// Collects a lender's events (lender_config::on_event runs on its thread).
struct event_recorder {
  std::shared_ptr<std::vector<lending::lender_event>> events = std::make_shared<std::vector<lending::lender_event>>();
  std::shared_ptr<std::mutex> guard = std::make_shared<std::mutex>();

  /// Records into this recorder from `config` on.
  void attach(lender_config& config) const {
    config.on_event = [events = events, guard = guard](const lending::lender_event& e) {
      std::lock_guard lock(*guard);
      events->push_back(e);
    };
  }
};

/// A lender on the host backend, its events recorded, and borrows that wait
/// at it on threads of their own (the waiting-borrow and preemption tests).
struct waiting_line {
  static constexpr auto answer_timeout = std::chrono::seconds(5);
  temp_dir dir;
  backend::device& dev = backend::host_device_instance();
  event_recorder recorder;
  std::unique_ptr<lender> l;

  explicit waiting_line(lender_config config) {
    recorder.attach(config);
    l = std::make_unique<lender>(dev, channel::channel_address::at_path(dir / "l.sock"), config);
  }
  // Borrows `bytes` on another thread, waiting up to `wait` for memory.
  std::future<lending::borrowed_region> borrow_waiting(borrower& b, std::size_t bytes, std::string purpose,
                                                       std::chrono::milliseconds wait) {
    return std::async(std::launch::async, [&b, bytes, purpose = std::move(purpose), wait] {
      return b.borrow(bytes, purpose, lending::region_mode::exclusive, answer_timeout, lending::borrow_wait{wait, {}});
    });
  }
  // Whether `count` borrows wait in line within the usual deadline.
  bool waiting(std::size_t count) {
    return eventually([&] { return l->status().waiting.size() == count; });
  }
};

template <class Backend>
class lending_test : public backend_test<Backend> {
 protected:
  lender& start(lender_config config = {}) {
    lender_ = std::make_unique<lender>(this->device(), channel::channel_address::at_path(dir_ / "lender.sock"), config);
    return *lender_;
  }
  std::string socket_path() const { return dir_ / "lender.sock"; }
  std::unique_ptr<child_process> borrower_process(const std::vector<std::string>& args) {
    std::vector<std::string> all{args.front(), Backend::name, socket_path()};
    all.insert(all.end(), args.begin() + 1, args.end());
    return std::make_unique<child_process>(SHOAL_TEST_BORROWER, all);
  }
  /// True on CUDA, which refuses to import memory in the process that
  /// exported it: the test is marked skipped, and the caller returns
  /// (`if (this->in_process_only()) return;`) — a skip in a helper does not
  /// end the test body by itself.
  [[nodiscard]] bool in_process_only() {
    if (std::string(Backend::name) != "cuda") return false;
    [] { GTEST_SKIP() << "CUDA refuses to import memory in the process that exported it"; }();
    return true;
  }
  std::size_t unit() { return this->device().granularity(); }

  temp_dir dir_;
  std::unique_ptr<lender> lender_;
};

}  // namespace shoal::testing
