#include "shoal/transfer/grouped_load.h"

#include <string>

#include "shoal/core/error.h"

namespace shoal::transfer {

struct grouped_load::state {
  backend::device* device = nullptr;
  std::vector<std::unique_ptr<backend::event>> ready;  // one per group, recorded after its copies
  std::vector<std::shared_ptr<const void>> keep_alive;

  state() = default;
  state(const state&) = delete;
  state& operator=(const state&) = delete;
  // The sources may be released only once no copy reads them any more.
  ~state() {
    if (ready.empty()) return;
    try {
      ready.back()->synchronize();
    } catch (...) {  // NOLINT(bugprone-empty-catch): a failed stream reads nothing more
    }
  }

  [[nodiscard]] backend::event& group(std::size_t k) const {
    if (k >= ready.size()) {
      throw invalid_argument("grouped_load: group " + std::to_string(k) + " does not exist (the load has " +
                             std::to_string(ready.size()) + " groups)");
    }
    return *ready[k];
  }
};

std::size_t grouped_load::groups() const noexcept { return state_->ready.size(); }

backend::event_ref grouped_load::group_ready(std::size_t k) const { return state_->group(k).ref(); }

void grouped_load::wait_for_group(std::size_t k, backend::stream_ref stream) const {
  state_->device->wait(stream, state_->group(k).ref());
}

bool grouped_load::is_group_ready(std::size_t k) const { return state_->group(k).query(); }

void grouped_load::synchronize() const { state_->ready.back()->synchronize(); }

namespace {

void validate(const std::vector<load_group>& groups) {
  if (groups.empty()) throw invalid_argument("load_groups: no groups to load");
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].copies.empty()) {
      throw invalid_argument("load_groups: group " + std::to_string(g) + " has no copies");
    }
    for (const group_copy& c : groups[g].copies) {
      if (c.device_destination == nullptr || c.host_source == nullptr || c.bytes == 0) {
        throw invalid_argument("load_groups: group " + std::to_string(g) +
                               " has a copy with a null pointer or zero bytes");
      }
    }
  }
}

}  // namespace

grouped_load load_groups(backend::device& device, backend::stream_ref copy_stream, std::vector<load_group> groups) {
  validate(groups);
  auto s = std::make_shared<grouped_load::state>();
  s->device = &device;
  s->ready.reserve(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) s->ready.push_back(std::make_unique<backend::event>(device));
  try {
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (const group_copy& c : groups[g].copies)
        device.copy(copy_stream, c.device_destination, c.host_source, c.bytes);
      s->ready[g]->record(copy_stream);
    }
  } catch (...) {
    // The copies already enqueued read the sources: they are released (with
    // the groups) only once those copies have run.
    try {
      device.synchronize(copy_stream);
    } catch (...) {  // NOLINT(bugprone-empty-catch): a failed stream reads nothing more
    }
    s->ready.clear();
    throw;
  }
  s->keep_alive.reserve(groups.size());
  for (load_group& g : groups) s->keep_alive.push_back(std::move(g.keep_alive));
  return grouped_load(std::move(s));
}

}  // namespace shoal::transfer
