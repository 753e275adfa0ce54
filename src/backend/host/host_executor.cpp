#include "backend/host/host_executor.h"

#include <chrono>
#include <cstdint>
#include <exception>
#include <random>
#include <utility>

#include "shoal/core/error.h"

namespace shoal::backend::detail {

namespace {

// The seed and the stream's number mixed into 32 bits (splitmix64's
// finalizer), the same on every platform.
std::uint32_t lag_seed(std::uint64_t seed, std::uint64_t number) {
  std::uint64_t z = seed + (number + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return static_cast<std::uint32_t>(z ^ (z >> 31));
}

}  // namespace

host_executor::state::state(std::optional<host_stream_slot> s, const host_stream_lag& lag, std::uint64_t number)
    : slot(std::move(s)),
      completed(slot ? slot->counter() : private_completed),
      submitted(completed.load(std::memory_order_acquire)),
      lag_max(lag.max.count() > 0 ? lag.max.count() : 0),
      lag_random(lag_seed(lag.seed, number)) {}

host_executor::host_executor(std::optional<host_stream_slot> slot, const host_stream_lag& lag, std::uint64_t number)
    : state_(std::make_shared<state>(std::move(slot), lag, number)) {
  // The thread owns the state too: detached (stop_when_drained), it runs its
  // last steps on the state after the executor may be gone.
  state_->thread = std::thread([s = state_] { run(*s); });
}

host_executor::~host_executor() {
  if (epoch_.forked_since()) {
    // The thread is not in this process: destroying the condition variable
    // it waited on would block forever, and the slot is the parent's. The
    // state stays as it is, unused.
    (void)new std::shared_ptr<state>(std::move(state_));  // NOLINT(cppcoreguidelines-owning-memory): left on purpose
    return;
  }
  if (!state_->thread.joinable()) return;  // detached: it ends once its work ran
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
  }
  state_->has_work.notify_one();
  state_->thread.join();
}

void host_executor::stop_when_drained() {
  if (epoch_.forked_since()) return;  // the thread is the parent's (see the destructor)
  // No one waits for it to end: whoever drops the executor last (an
  // event's owner, another stream's wait) must not join a thread whose work
  // may wait for that very owner.
  // Detached before it is told to stop, while it cannot end (it runs until
  // `stopping`): glibc's pthread_detach reads the thread's descriptor again
  // after marking it detached, and a thread that ended meanwhile has freed
  // that descriptor with its stack (a crash seen about once in a million
  // streams made and destroyed).
  state_->thread.detach();
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
  }
  state_->has_work.notify_one();
}

void host_executor::throw_forked(const std::string& what) {
  throw device_unavailable("host device: cannot " + what +
                           " in a fork() child; the device and its streams were opened in the parent process, and "
                           "their worker threads do not exist here. Start child processes with spawn or forkserver, "
                           "or open the device only after fork()");
}

void host_executor::throw_if_forked(const char* what) const {
  if (epoch_.forked_since()) throw_forked(what);
}

std::uint64_t host_executor::submit(std::function<void()> work) {
  throw_if_forked("enqueue work on a stream");
  std::uint64_t ticket;
  {
    std::lock_guard lock(state_->mutex);
    if (state_->stopping) throw invalid_argument("host stream: work enqueued on a stream that was destroyed");
    state_->queue.push_back(std::move(work));
    ticket = state_->submitted.load(std::memory_order_relaxed) + 1;
    state_->submitted.store(ticket, std::memory_order_release);
  }
  state_->has_work.notify_one();
  return ticket;
}

std::uint64_t host_executor::submitted() const { return state_->submitted.load(std::memory_order_acquire); }

void host_executor::wait_for(std::uint64_t ticket) const {
  std::uint64_t seen = state_->completed.load(std::memory_order_acquire);
  if (seen < ticket) throw_if_forked("wait for stream work enqueued before fork()");
  while (seen < ticket) {
    state_->completed.wait(seen, std::memory_order_acquire);
    seen = state_->completed.load(std::memory_order_acquire);
  }
}

std::string host_executor::take_error() {
  // A fork() child ran none of the work: no failure of it is its to take
  // (and the mutex may be held by a parent's thread forever).
  if (epoch_.forked_since()) return {};
  std::lock_guard lock(state_->mutex);
  return std::exchange(state_->first_error, {});
}

void host_executor::run(state& s) {
  for (;;) {
    std::function<void()> work;
    {
      std::unique_lock lock(s.mutex);
      s.has_work.wait(lock, [&] { return s.stopping || !s.queue.empty(); });
      if (s.queue.empty()) return;  // stopping, and everything has run
      work = std::move(s.queue.front());
      s.queue.pop_front();
    }
    if (s.lag_max > 0) {
      const auto pause = std::uniform_int_distribution<std::chrono::microseconds::rep>(0, s.lag_max)(s.lag_random);
      std::this_thread::sleep_for(std::chrono::microseconds(pause));
    }
    try {
      work();
    } catch (const std::exception& e) {
      std::lock_guard lock(s.mutex);
      if (s.first_error.empty()) s.first_error = e.what();
    } catch (...) {
      std::lock_guard lock(s.mutex);
      if (s.first_error.empty()) s.first_error = "work threw an exception that is not a std::exception";
    }
    work = nullptr;  // what the work captured is released before the stream passes it
    // Release: whoever sees the new count also sees the work's writes.
    s.completed.fetch_add(1, std::memory_order_release);
    s.completed.notify_all();
  }
}

}  // namespace shoal::backend::detail
