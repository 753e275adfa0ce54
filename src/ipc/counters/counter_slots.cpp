#include "ipc/counters/counter_slots.h"

#include <string>
#include <utility>

#include "core/process_wide_id.h"
#include "shoal/core/error.h"

namespace shoal::ipc::detail {

namespace {

bool same_process(const process_identity& a, const process_identity& b) {
  return a.pid == b.pid && a.start_time == b.start_time;
}

std::pair<pid_t, std::uint64_t> key_of(const process_identity& p) { return {p.pid, p.start_time}; }

// A failed /proc read tells nothing: the process counts as alive, and the
// next pass looks again.
bool is_alive_or_unknown(const process_identity& p) {
  try {
    return is_alive(p);
  } catch (const error&) {
    return true;
  }
}

}  // namespace

counter_slots::counter_slots(std::uint32_t slots_per_file) : slots_per_file_(slots_per_file) {
  if (slots_per_file == 0) throw invalid_argument("sharing: slots_per_file is 0; a counter file needs at least one slot");
}

std::pair<std::uint64_t, counter_slots::file_entry*> counter_slots::file_for(const process_identity& holder) {
  for (auto& [id, e] : files_) {
    if (same_process(e->holder, holder) && !e->holder_dead && !e->free_slots.empty()) return {id, e.get()};
  }
  const std::uint64_t id = shoal::detail::next_process_wide_id();
  auto e = std::make_unique<file_entry>(file_entry{std::make_shared<counter_file>(counter_file::create(slots_per_file_)), holder, false, {}, {}, {}});
  e->free_slots.reserve(slots_per_file_);
  for (std::uint32_t i = slots_per_file_; i > 0; --i) e->free_slots.push_back(i - 1);
  e->generations.assign(slots_per_file_, 0);
  return {id, files_.emplace(id, std::move(e)).first->second.get()};
}

slot_ref counter_slots::claim(const process_identity& holder, std::uintptr_t block, std::size_t bytes) {
  auto [file_id, e] = file_for(holder);
  const std::uint32_t index = e->free_slots.back();
  const slot_ticket ticket{index, ++e->generations[index]};
  e->file->claim(ticket, holder);
  e->free_slots.pop_back();
  e->handed_out.emplace(index, handed_slot{ticket.generation, block, bytes});
  ++in_use_;
  return {file_id, ticket};
}

bool counter_slots::released(const slot_ref& slot) const {
  auto it = files_.find(slot.file_id);
  return it != files_.end() && it->second->file->released(slot.ticket);
}

void counter_slots::release(const slot_ref& slot) {
  if (auto it = files_.find(slot.file_id); it != files_.end()) it->second->file->release(slot.ticket);
}

void counter_slots::recycle(const slot_ref& slot) {
  file_entry& e = entry(slot.file_id);
  e.file->recycle(slot.ticket);
  e.handed_out.erase(slot.ticket.index);
  e.free_slots.push_back(slot.ticket.index);
  --in_use_;
  close_if_unused(slot.file_id, e);
}

void counter_slots::close_if_unused(std::uint64_t file_id, const file_entry& e) {
  if (!e.handed_out.empty()) return;
  const auto record = holders_.find(key_of(e.holder));
  if (!e.holder_dead && record != holders_.end() && record->second.connections > 0) {
    for (auto it = files_.rbegin(); it != files_.rend(); ++it) {
      if (same_process(it->second->holder, e.holder)) {
        if (it->first == file_id) return;  // the living holder's newest stays for its next claims
        break;
      }
    }
  }
  closed_.push_back({file_id, e.holder});
  files_.erase(file_id);  // `e` goes with it
}

std::size_t counter_slots::reclaim_dead_holders() {
  std::size_t reclaimed = 0;
  std::vector<std::uint64_t> unused;
  std::map<std::pair<pid_t, std::uint64_t>, bool> alive;  // one /proc read per holder
  for (auto& [id, e] : files_) {
    if (!e->holder_dead) {
      auto [it, fresh] = alive.try_emplace(key_of(e->holder), true);
      if (fresh) it->second = is_alive_or_unknown(e->holder);
      if (it->second) continue;
      e->holder_dead = true;
      for (const auto& [index, handed] : e->handed_out) {
        if (e->file->take_back({index, handed.generation})) ++reclaimed;
      }
    }
    if (e->handed_out.empty()) unused.push_back(id);  // a dead holder's file with nothing out
  }
  for (auto id : unused) close_if_unused(id, *files_.at(id));
  // A revoked holder no longer connected is remembered until it dies.
  std::erase_if(holders_, [&](const auto& h) {
    if (h.second.connections > 0) return false;
    const auto known = alive.find(h.first);
    return known != alive.end() ? !known->second : !is_alive_or_unknown({h.first.first, h.first.second});
  });
  return reclaimed;
}

void counter_slots::connect(const process_identity& holder) { ++holders_[key_of(holder)].connections; }

void counter_slots::disconnect(const process_identity& holder) {
  const auto it = holders_.find(key_of(holder));
  if (it == holders_.end() || it->second.connections == 0) return;
  if (--it->second.connections > 0) return;
  if (!it->second.revoked) holders_.erase(it);
  std::vector<std::uint64_t> unused;
  for (const auto& [id, e] : files_) {
    if (same_process(e->holder, holder) && e->handed_out.empty()) unused.push_back(id);
  }
  for (auto id : unused) close_if_unused(id, *files_.at(id));
}

void counter_slots::revoke(const process_identity& holder) { holders_[key_of(holder)].revoked = true; }

bool counter_slots::revoked(const process_identity& holder) const {
  const auto it = holders_.find(key_of(holder));
  return it != holders_.end() && it->second.revoked;
}

std::vector<held_reference> counter_slots::held() const {
  std::vector<held_reference> out;
  for (const auto& [id, e] : files_) {
    for (const auto& [index, handed] : e->handed_out) {
      if (!e->file->released({index, handed.generation})) out.push_back({e->holder, handed.block, handed.bytes});
    }
  }
  return out;
}

std::vector<holder_info> counter_slots::holders() const {
  std::map<holder_key, holder_info> out;
  for (const auto& [key, record] : holders_) out[key] = {{key.first, key.second}, record.connections, record.revoked};
  for (const auto& [id, e] : files_) out.try_emplace(key_of(e->holder), holder_info{e->holder, 0, false});
  std::vector<holder_info> list;
  for (auto& [key, info] : out) list.push_back(info);
  return list;
}

std::shared_ptr<const counter_file> counter_slots::file(std::uint64_t file_id) const {
  auto it = files_.find(file_id);
  if (it == files_.end()) throw invalid_argument("sharing: no counter file has id " + std::to_string(file_id));
  return it->second->file;
}

counter_slots::file_entry& counter_slots::entry(std::uint64_t file_id) {
  auto it = files_.find(file_id);
  if (it == files_.end()) throw invalid_argument("sharing: no counter file has id " + std::to_string(file_id));
  return *it->second;
}

std::vector<closed_file> counter_slots::take_closed_files() { return std::exchange(closed_, {}); }

}  // namespace shoal::ipc::detail
