#include "shoal/alloc/caching_allocator.h"

#include "alloc/allocator_core.h"
#include "alloc/core_util.h"
#include "shoal/backend/stream.h"

namespace shoal::alloc {

caching_allocator::caching_allocator(backend::device& device, allocator_config config)
    : core_(std::make_unique<detail::allocator_core>(device, std::move(config))) {}

caching_allocator::~caching_allocator() = default;

backend::device& caching_allocator::device() const noexcept { return core_->device; }
const allocator_config& caching_allocator::config() const noexcept { return core_->config; }

void* caching_allocator::allocate(std::size_t bytes, backend::stream_ref stream) { return core_->allocate(bytes, stream); }
void* caching_allocator::allocate(std::size_t bytes) {
  return core_->allocate(bytes, backend::current_stream(core_->device));
}
void* caching_allocator::allocate_claimed(std::size_t bytes, backend::stream_ref stream) {
  return core_->allocate(bytes, stream, true);
}
void caching_allocator::deallocate(void* ptr, backend::stream_ref stream) { core_->deallocate(ptr, stream); }
void caching_allocator::deallocate(void* ptr) { core_->deallocate(ptr, backend::current_stream(core_->device)); }
void caching_allocator::deallocate_or_wait(void* ptr, backend::stream_ref stream) {
  core_->deallocate_or_wait(ptr, stream);
}
bool caching_allocator::deallocate_without_events(void* ptr, backend::stream_ref stream) {
  return core_->deallocate(ptr, stream, false);
}
void caching_allocator::record_stream(void* ptr, backend::stream_ref stream) { core_->record_stream(ptr, stream); }
std::size_t caching_allocator::block_size(const void* ptr) const { return core_->block_size(ptr); }
std::optional<block_segment> caching_allocator::segment_of_allocated_block(const void* ptr) const {
  return core_->segment_of_allocated_block(ptr);
}
void caching_allocator::mark_held_outside(void* ptr) { core_->mark_held_outside(ptr); }
void caching_allocator::unmark_held_outside(void* ptr) { core_->unmark_held_outside(ptr); }
void caching_allocator::claim(void* ptr) { core_->claim(ptr); }

void caching_allocator::process_pending_frees() { core_->process_pending_frees(); }
void caching_allocator::set_memory_fraction(double fraction) { core_->set_memory_fraction(fraction); }
std::size_t caching_allocator::memory_limit() const noexcept { return core_->memory_limit(); }
void caching_allocator::empty_cache() { core_->empty_cache(); }

allocator_stats caching_allocator::stats() const { return core_->stats(); }
void caching_allocator::reset_peak_stats() { core_->reset_peak_stats(); }
void caching_allocator::reset_accumulated_stats() { core_->reset_accumulated_stats(); }
snapshot caching_allocator::take_snapshot() const { return core_->take_snapshot(); }
std::size_t caching_allocator::largest_free_block() const { return core_->largest_free_block(); }
std::vector<trace_entry> caching_allocator::trace() const { return core_->trace(); }
void caching_allocator::check_invariants() const { core_->check_invariants(); }
std::uint64_t caching_allocator::add_oom_observer(std::function<void(const oom_report&)> observer) {
  return core_->add_oom_observer(std::move(observer));
}

bool caching_allocator::remove_oom_observer(std::uint64_t id) { return core_->remove_oom_observer(id); }

std::uint64_t caching_allocator::add_cache_miss_hook(std::function<void()> hook) {
  return core_->hooks.add_miss_hook(std::move(hook));
}

std::uint64_t caching_allocator::add_forced_clear_hook(std::function<void()> hook) {
  return core_->hooks.add_forced_clear_hook(std::move(hook));
}
std::uint64_t caching_allocator::add_release_observer(
    std::function<void(std::uintptr_t base, std::size_t bytes)> observer) {
  return core_->hooks.add_release_observer(std::move(observer));
}
std::uint64_t caching_allocator::add_segment_observer(std::function<void(const segment_event&)> observer) {
  return core_->hooks.add_segment_observer(std::move(observer));
}
std::uint64_t caching_allocator::add_free_wait_observer(std::function<void(const free_wait_event&)> observer) {
  return core_->hooks.add_free_wait_observer(std::move(observer));
}
void caching_allocator::remove_hook(std::uint64_t id) { core_->hooks.remove(id); }

private_pool_id caching_allocator::create_private_pool(void* base, std::size_t bytes,
                                                       const std::vector<std::pair<std::string, std::size_t>>& parts) {
  return core_->create_private_pool(base, bytes, parts);
}
private_pool_id caching_allocator::create_growing_private_pool() { return core_->create_growing_private_pool(); }
void caching_allocator::forget_last_streams(private_pool_id pool) { core_->forget_last_streams(pool); }
pool_checkpoint caching_allocator::checkpoint_private_pool(private_pool_id pool) {
  return core_->checkpoint_private_pool(pool);
}
pool_restore_result caching_allocator::restore_private_pool(private_pool_id pool, const pool_checkpoint& checkpoint) {
  return core_->restore_private_pool(pool, checkpoint);
}
std::vector<void*> caching_allocator::private_pool_allocated_blocks(private_pool_id pool) const {
  return core_->private_pool_allocated_blocks(pool);
}
void caching_allocator::drain_private_pool(private_pool_id pool, const std::string& part) {
  core_->drain_private_pool(pool, part);
}

invalidated_blocks_report caching_allocator::clear_private_pool(private_pool_id pool, const std::string& part,
                                                                live_blocks live) {
  return core_->clear_private_pool(pool, part, live);
}
invalidated_blocks_report caching_allocator::destroy_private_pool(private_pool_id pool, live_blocks live) {
  return core_->destroy_private_pool(pool, live);
}

no_host_waits_scope::no_host_waits_scope() noexcept { ++detail::no_host_waits_depth; }
no_host_waits_scope::~no_host_waits_scope() { --detail::no_host_waits_depth; }

private_pool_scope::private_pool_scope(caching_allocator& allocator, private_pool_id pool, const std::string& part)
    : allocator_(allocator) {
  const detail::pool_direction previous = allocator.core_->direct_to(allocator.core_->direction_to(pool, part));
  previous_ = previous.part;
  previous_generation_ = previous.generation;
}

private_pool_scope::~private_pool_scope() {
  allocator_.core_->direct_to({static_cast<detail::block_pool*>(previous_), previous_generation_});
}

}  // namespace shoal::alloc
