#include "shoal/transfer/transfer_engine.h"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <new>
#include <string>
#include <system_error>
#include <utility>

#include "alloc/size_policy.h"
#include "core/deadline.h"
#include "core/fork_epoch.h"
#include "shoal/core/error.h"
#include "transfer/batch_copier.h"
#include "transfer/batch_state.h"

namespace shoal::transfer {

namespace {

const transfer_config& checked(const transfer_config& c) {
  if (c.max_batches_in_flight == 0) {
    throw invalid_argument("transfer_engine: max_batches_in_flight is 0; allow at least one batch in flight");
  }
  if (c.max_bytes_in_flight == 0) {
    throw invalid_argument("transfer_engine: max_bytes_in_flight is 0; allow at least one byte in flight");
  }
  if (c.staging_chunk_bytes == 0) throw invalid_argument("transfer_engine: staging_chunk_bytes is 0");
  if (c.staging_chunk_bytes > alloc::detail::max_request) {
    throw invalid_argument("transfer_engine: staging_chunk_bytes (" + std::to_string(c.staging_chunk_bytes) +
                           ") is more than one allocation may ask for (" +
                           std::to_string(alloc::detail::max_request) + " bytes)");
  }
  if (c.staging_helpers > 64 && c.staging_helpers != transfer_config::automatic_staging_helpers) {
    throw invalid_argument("transfer_engine: staging_helpers is " + std::to_string(c.staging_helpers) +
                           "; more than 64 helper threads only contend for memory bandwidth");
  }
  if (c.max_pinned_bytes < alloc::allocator_config::smallest_reservation) {
    throw invalid_argument("transfer_engine: max_pinned_bytes (" + std::to_string(c.max_pinned_bytes) +
                           ") is below " + std::to_string(alloc::allocator_config::smallest_reservation >> 20) +
                           " MiB, the least pinned memory staging reserves: no array could be staged");
  }
  // A chunk takes its pinned segment, not its bytes: a 3 MiB chunk holds 4 MiB.
  if (const std::size_t takes = pinned_bytes_of_chunk(c);
      c.max_pinned_bytes < takes) {
    throw invalid_argument("transfer_engine: max_pinned_bytes (" + std::to_string(c.max_pinned_bytes) +
                           ") is smaller than the pinned memory one staging chunk takes (staging_chunk_bytes " +
                           std::to_string(c.staging_chunk_bytes) + ", rounded up to the pinned allocator's segment: " +
                           std::to_string(takes) + "); raise max_pinned_bytes or lower staging_chunk_bytes");
  }
  return c;
}

// The most bytes a batch may hold in all: what one address space can. So
// neither a batch's sum nor that of two batches in flight wraps around (a
// batch that wrapped would count as next to nothing in flight).
constexpr std::size_t max_batch_bytes = PTRDIFF_MAX;

// The batch's bytes in all, once every buffer is checked.
std::size_t checked_bytes(const std::vector<host_buffer>& batch) {
  if (batch.empty()) throw invalid_argument("transfer_engine::submit: the batch has no buffers");
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    if (batch[i].bytes == 0 || batch[i].data == nullptr) {
      throw invalid_argument("transfer_engine::submit: buffer " + std::to_string(i) + " is " +
                             (batch[i].data == nullptr ? "null" : "empty") +
                             "; every buffer needs data and at least one byte");
    }
    if (batch[i].bytes > max_batch_bytes - bytes) {
      throw invalid_argument("transfer_engine::submit: buffer " + std::to_string(i) + " (" +
                             std::to_string(batch[i].bytes) + " bytes) takes the batch past " +
                             std::to_string(max_batch_bytes) +
                             " bytes in all, more than an address space holds; check the buffers' sizes");
    }
    bytes += batch[i].bytes;
  }
  return bytes;
}

template <class Predicate>
bool wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout,
                Predicate ready) {
  if (timeout == transfer_engine::forever) {
    cv.wait(lock, ready);
    return true;
  }
  // A saturated deadline, not wait_for: libstdc++ adds a wait_for's timeout
  // to the clock in nanoseconds, which overflows past 292 years.
  return cv.wait_until(lock, shoal::detail::deadline_after(timeout), ready);
}

// The engine's thread running `body`; backend_error when the process may
// start no more threads.
template <class Body>
std::thread started(Body body) {
  try {
    return std::thread(std::move(body));
  } catch (const std::system_error& e) {
    throw backend_error("std::thread", std::string("the engine's thread could not be started (") + e.what() +
                                           "); raise the process's thread limit");
  }
}

}  // namespace

// ---- transferred_batch ------------------------------------------------------------

std::uint64_t transferred_batch::sequence() const noexcept { return state_->sequence; }
const std::vector<storage::storage>& transferred_batch::storages() const noexcept { return state_->storages; }
backend::event_ref transferred_batch::ready() const noexcept { return state_->ready->ref(); }

void transferred_batch::wait_on(backend::stream_ref stream) const {
  state_->device->wait(stream, state_->ready->ref());
  for (const auto& s : state_->storages) s.record_stream(stream);
}

void transferred_batch::synchronize() const { state_->ready->synchronize(); }
bool transferred_batch::is_ready() const { return state_->ready->query(); }

// ---- transfer_engine ----------------------------------------------------------------

struct transfer_engine::wake_ups {
  const shoal::detail::fork_epoch epoch;
  std::condition_variable work_ready, outcome_ready, room_ready;
};

transfer_engine::transfer_engine(alloc::caching_allocator& device_allocator, backend::stream_ref copy_stream,
                                 transfer_config config)
    : device_allocator_(device_allocator),
      config_(checked(config)),
      stream_(copy_stream),
      copier_(std::make_unique<batch_copier>(device_allocator, stream_, config_)),
      wake_(std::make_unique<wake_ups>()),
      worker_(started([this] { run(); })) {}

transfer_engine::~transfer_engine() {
  if (wake_->epoch.forked_since()) {
    // A fork() child: the worker and the copier's helper threads stayed
    // with the parent; destroying the condition variables they waited on
    // would block forever. Batches not taken are dropped (their frees do
    // nothing here: the memory is the parent's).
    shoal::detail::leave_parents_thread(std::move(worker_));
    (void)wake_.release();
    (void)copier_.release();
    return;
  }
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_->work_ready.notify_all();
  worker_.join();
  outcomes_.clear();  // batches not taken: freed on the engine's stream, after their copies
  copier_.reset();    // waits for every copy, then lets go of the sources
}

namespace {

// Before any lock: in a fork() child the parent's worker may have held it.
void refuse_in_fork_child(const shoal::detail::fork_epoch& epoch, const char* call) {
  if (!epoch.forked_since()) return;
  throw device_unavailable(std::string("transfer_engine::") + call +
                           ": this engine was made in the parent process, and this is a fork() child; its thread "
                           "stayed with the parent, so nothing would be copied. Start child processes with spawn or "
                           "forkserver, or make the engine only after fork()");
}

}  // namespace

std::uint64_t transfer_engine::submit(std::vector<host_buffer> batch, std::chrono::milliseconds timeout,
                                      std::shared_ptr<const void> tag) {
  refuse_in_fork_child(wake_->epoch, "submit");
  const std::size_t bytes = checked_bytes(batch);
  // Made before the lock, so that a batch not queued (a timeout, a failed
  // push) lets go of its sources and tag after the lock: their release may
  // run their owners' deleters, which must never run under mutex_ (see run()).
  job queued{0, std::move(batch), std::move(tag)};
  std::unique_lock lock(mutex_);
  // Within both bounds, or with at most one other batch whatever the bytes:
  // a producer may always have one batch in flight beside the one it is
  // about to take (submitting one ahead from the consumer's own thread would
  // otherwise wait for ever once two batches pass max_bytes_in_flight).
  // (No call is in progress while the engine is destroyed, so this wait
  // never sees it stop.)
  const bool room = wait_until(wake_->room_ready, lock, timeout, [&] {
    return counters_.in_flight < config_.max_batches_in_flight &&
           (counters_.in_flight < 2 || fits_beside(counters_.bytes_in_flight, bytes, config_.max_bytes_in_flight));
  });
  if (!room) {
    throw timeout_error("transfer_engine::submit: " + std::to_string(counters_.in_flight) + " batches of " +
                        std::to_string(counters_.bytes_in_flight) + " bytes in all are still in flight after " +
                        std::to_string(timeout.count()) + " ms (limits: " +
                        std::to_string(config_.max_batches_in_flight) + " batches, " +
                        std::to_string(config_.max_bytes_in_flight) + " bytes; this batch: " + std::to_string(bytes) +
                        "); take batches with next() or raise max_batches_in_flight or max_bytes_in_flight");
  }
  const std::uint64_t sequence = next_sequence_;
  queued.sequence = sequence;
  jobs_.push_back(std::move(queued));  // on a throw (no memory) nothing changed: `queued` goes after the lock
  ++next_sequence_;
  ++counters_.batches_submitted;
  counters_.peak_in_flight = std::max(counters_.peak_in_flight, ++counters_.in_flight);
  counters_.bytes_in_flight += bytes;
  counters_.peak_bytes_in_flight = std::max(counters_.peak_bytes_in_flight, counters_.bytes_in_flight);
  lock.unlock();
  wake_->work_ready.notify_one();
  return sequence;
}

namespace {

transferred_batch batch_or_error(transfer_engine::taken_batch taken) {
  if (taken.error) std::rethrow_exception(taken.error);
  return std::move(*taken.batch);
}

}  // namespace

std::optional<transferred_batch> transfer_engine::try_next() {
  refuse_in_fork_child(wake_->epoch, "try_next");
  std::unique_lock lock(mutex_);
  if (outcomes_.empty()) return std::nullopt;
  return batch_or_error(take_locked(lock));
}

transferred_batch transfer_engine::next(std::chrono::milliseconds timeout) {
  return batch_or_error(take(timeout, "next"));
}

transfer_engine::taken_batch transfer_engine::take(std::chrono::milliseconds timeout) { return take(timeout, "take"); }

transfer_engine::taken_batch transfer_engine::take(std::chrono::milliseconds timeout, const char* call) {
  refuse_in_fork_child(wake_->epoch, call);
  std::unique_lock lock(mutex_);
  if (!wait_until(wake_->outcome_ready, lock, timeout, [&] { return !outcomes_.empty(); })) {
    throw timeout_error(std::string("transfer_engine::") + call + ": no batch was transferred within " +
                        std::to_string(timeout.count()) + " ms (" + std::to_string(counters_.in_flight) +
                        " in flight)");
  }
  return take_locked(lock);
}

transfer_engine::taken_batch transfer_engine::take_locked(std::unique_lock<std::mutex>& lock) {
  outcome o = std::move(outcomes_.front());
  outcomes_.pop_front();
  ++counters_.batches_taken;
  --counters_.in_flight;
  counters_.bytes_in_flight -= o.bytes;
  lock.unlock();  // `o` (its tag, its batch) goes without the lock
  wake_->room_ready.notify_all();  // the room made may fit several smaller batches, or not the first waiter's
  if (o.error) return {o.sequence, std::nullopt, std::move(o.error), std::move(o.tag)};
  return {o.sequence, transferred_batch(std::move(o.batch)), nullptr, std::move(o.tag)};
}

transfer_stats transfer_engine::stats() const {
  refuse_in_fork_child(wake_->epoch, "stats");
  transfer_stats s;
  {
    std::lock_guard lock(mutex_);
    s = counters_;
  }
  s.bytes_copied = copier_->bytes_copied();
  s.bytes_staged = copier_->bytes_staged();
  s.copies = copier_->copies();
  s.pinned = copier_->pinned_stats();
  return s;
}

void transfer_engine::run() noexcept {
  std::vector<job> group;
  // The group's outcomes, made before its jobs leave jobs_ (take_group_locked)
  // and spliced into outcomes_ once copied: nothing after the take allocates,
  // so every batch taken reaches outcomes_. Nodes left over serve later groups.
  std::list<outcome> room;
  for (;;) {
    {
      // Without the lock: letting go of a source may run its owner's deleter
      // (the Python bindings' takes the GIL), and a thread holding what that
      // deleter waits for may be waiting for mutex_ (stats() under the GIL).
      // Only this thread touches the copier's held sources.
      const bool holding = copier_->release_finished();
      std::unique_lock lock(mutex_);
      // With sources still held, look at their copies every millisecond;
      // otherwise sleep until there is work.
      const auto has_work = [&] { return stopping_ || !jobs_.empty(); };
      if (holding) {
        wake_->work_ready.wait_for(lock, std::chrono::milliseconds(1), has_work);
      } else {
        wake_->work_ready.wait(lock, has_work);
      }
      if (jobs_.empty()) {
        if (stopping_) return;
        continue;
      }
      if (!take_group_locked(group, room)) {
        // No host memory for even one batch's room: the jobs stay queued
        // until some comes back. As the engine is destroyed they are dropped
        // with it (nothing could take them any more).
        if (stopping_) return;
        wake_->work_ready.wait_for(lock, std::chrono::milliseconds(1), [&] { return stopping_; });
        continue;
      }
    }
    copy_or_fail(group, room);
    // One outcome per job, in their order (copy and copy_or_fail promise
    // it): each tag goes with its own batch.
    auto done_end = room.begin();
    for (job& j : group) {
      done_end->tag = std::move(j.tag);
      ++done_end;
    }
    group.clear();  // sources staged or held by the copier: let go of the rest outside the lock
    {
      std::lock_guard lock(mutex_);
      ++counters_.coalesced_groups;
      for (auto o = room.begin(); o != done_end; ++o) {
        ++(o->error ? counters_.batches_failed : counters_.batches_transferred);
      }
      outcomes_.splice(outcomes_.end(), room, room.begin(), done_end);
    }
    wake_->outcome_ready.notify_all();
  }
}

void transfer_engine::copy_or_fail(std::span<job> group, std::list<outcome>& room) noexcept {
  try {
    std::vector<outcome> done = copier_->copy(group);
    std::move(done.begin(), done.end(), room.begin());
  } catch (...) {
    // Host memory for the copier's own bookkeeping ran out: each batch of
    // the group fails with that error rather than ending the process.
    auto node = room.begin();
    for (const job& j : group) *node++ = outcome{j.sequence, j.bytes(), nullptr, std::current_exception(), nullptr};
  }
}

bool transfer_engine::take_group_locked(std::vector<job>& group, std::list<outcome>& room) {
  // The first job goes whatever its size; the next while the group stays
  // within max_coalesced_bytes. jobs_ holds at most max_batches_in_flight
  // jobs and max_bytes_in_flight bytes (each is in flight), or one job, so a
  // group holds no more (the copier's queue bound needs that).
  std::size_t count = 0;
  std::size_t bytes = 0;
  for (const job& j : jobs_) {
    const std::size_t next_bytes = j.bytes();
    if (count > 0 && bytes + next_bytes > config_.max_coalesced_bytes) break;
    bytes += next_bytes;
    ++count;
  }
  // Room first, while every job is still in jobs_; short of host memory, as
  // many as there is room for (the others go in a later group).
  try {
    group.reserve(count);
  } catch (const std::bad_alloc&) {  // NOLINT(bugprone-empty-catch): the capacity it has bounds the group
  }
  count = std::min(count, group.capacity());
  try {
    while (room.size() < count) room.emplace_back();
  } catch (const std::bad_alloc&) {
    count = room.size();
  }
  for (std::size_t i = 0; i < count; ++i) {
    group.push_back(std::move(jobs_.front()));  // within the capacity reserved: no allocation
    jobs_.pop_front();
  }
  return count > 0;
}

}  // namespace shoal::transfer
