#include "backend/host/host_executor.h"

#include <exception>
#include <utility>

namespace shoal::backend::detail {

host_executor::host_executor(std::optional<host_stream_slot> slot)
    : slot_(std::move(slot)),
      completed_(slot_ ? slot_->counter() : private_completed_),
      submitted_(completed_.load(std::memory_order_acquire)),
      thread_([this] { run(); }) {}

host_executor::~host_executor() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  has_work_.notify_one();
  thread_.join();
}

std::uint64_t host_executor::submit(std::function<void()> work) {
  std::uint64_t ticket;
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(work));
    ticket = ++submitted_;
  }
  has_work_.notify_one();
  return ticket;
}

std::uint64_t host_executor::submitted() const {
  std::lock_guard lock(mutex_);
  return submitted_;
}

void host_executor::wait_for(std::uint64_t ticket) const {
  std::uint64_t seen = completed_.load(std::memory_order_acquire);
  while (seen < ticket) {
    completed_.wait(seen, std::memory_order_acquire);
    seen = completed_.load(std::memory_order_acquire);
  }
}

std::string host_executor::take_error() {
  std::lock_guard lock(mutex_);
  return std::exchange(first_error_, {});
}

void host_executor::run() {
  for (;;) {
    std::function<void()> work;
    {
      std::unique_lock lock(mutex_);
      has_work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything has run
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      work();
    } catch (const std::exception& e) {
      std::lock_guard lock(mutex_);
      if (first_error_.empty()) first_error_ = e.what();
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (first_error_.empty()) first_error_ = "work threw an exception that is not a std::exception";
    }
    work = nullptr;  // what the work captured is released before the stream passes it
    // Release: whoever sees the new count also sees the work's writes.
    completed_.fetch_add(1, std::memory_order_release);
    completed_.notify_all();
  }
}

}  // namespace shoal::backend::detail
