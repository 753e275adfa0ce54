#include "ipc/counters/counter_slots.h"

#include "core/process_wide_id.h"

#include <string>
#include <utility>

#include "shoal/core/error.h"

namespace shoal::ipc::detail {

counter_slots::counter_slots(std::uint32_t slots_per_file) : slots_per_file_(slots_per_file) {
  if (slots_per_file == 0) throw invalid_argument("sharing: slots_per_file is 0; a counter file needs at least one slot");
}

slot_ref counter_slots::claim(const process_identity& holder) {
  // Lowest file id with a free slot: keeps references packed into few files.
  file_entry* target = nullptr;
  std::uint64_t target_id = 0;
  for (auto& [id, e] : files_) {
    if (!e->free_slots.empty()) {
      target = e.get();
      target_id = id;
      break;
    }
  }
  if (target == nullptr) {
    target_id = shoal::detail::next_process_wide_id();
    auto e = std::make_unique<file_entry>(file_entry{counter_file::create(slots_per_file_), {}, 0});
    e->free_slots.reserve(slots_per_file_);
    for (std::uint32_t i = slots_per_file_; i > 0; --i) e->free_slots.push_back(i - 1);
    target = files_.emplace(target_id, std::move(e)).first->second.get();
  }
  const std::uint32_t index = target->free_slots.back();
  const slot_ticket ticket = target->file.claim(index, holder);
  target->free_slots.pop_back();
  ++target->in_use;
  ++in_use_;
  return {target_id, ticket};
}

bool counter_slots::released(const slot_ref& slot) const {
  auto it = files_.find(slot.file_id);
  return it != files_.end() && it->second->file.released(slot.ticket);
}

void counter_slots::release(const slot_ref& slot) { entry(slot.file_id).file.release(slot.ticket); }

void counter_slots::recycle(const slot_ref& slot) {
  file_entry& e = entry(slot.file_id);
  e.file.recycle(slot.ticket);
  e.free_slots.push_back(slot.ticket.index);
  --e.in_use;
  --in_use_;
  if (e.in_use == 0 && slot.file_id != files_.rbegin()->first) {
    files_.erase(slot.file_id);
    closed_.push_back(slot.file_id);
  }
}

std::size_t counter_slots::reclaim_dead_holders() {
  std::size_t reclaimed = 0;
  std::map<std::pair<pid_t, std::uint64_t>, bool> alive;  // one /proc read per holder
  for (auto& [id, e] : files_) {
    if (e->in_use == 0) continue;
    for (std::uint32_t i = 0; i < slots_per_file_; ++i) {
      const auto held = e->file.held_ticket(i);
      if (!held) continue;
      const process_identity holder = e->file.holder(i);
      auto [it, fresh] = alive.try_emplace({holder.pid, holder.start_time}, false);
      if (fresh) it->second = is_alive(holder);
      if (!it->second && e->file.reclaim(*held)) ++reclaimed;
    }
  }
  return reclaimed;
}

const counter_file& counter_slots::file(std::uint64_t file_id) const {
  auto it = files_.find(file_id);
  if (it == files_.end()) throw invalid_argument("sharing: no counter file has id " + std::to_string(file_id));
  return it->second->file;
}

counter_slots::file_entry& counter_slots::entry(std::uint64_t file_id) {
  auto it = files_.find(file_id);
  if (it == files_.end()) throw invalid_argument("sharing: no counter file has id " + std::to_string(file_id));
  return *it->second;
}

std::vector<std::uint64_t> counter_slots::take_closed_files() { return std::exchange(closed_, {}); }

}  // namespace shoal::ipc::detail
