// What a consumer table could not close when it went (its destructor, past
// sharing_options::teardown_timeout): mappings whose received storages'
// releases still wait to count down, their streams waiting for a ready point
// the producer has not passed, and the event sources those waits may read.
// They stay mapped, and counted in the context's holdings, until their last
// view goes; then the context's collector (or a table needing room) closes
// them and gives their counts back. A later table of the same producer counts
// what it left here against its own limits (max_peer_segments,
// max_peer_mapped_bytes), so a producer that stalls and reconnects holds no
// more than one connection could.
//
// Thread-safety: any thread. One mutex, taken after a table's and never
// before one: closes run under it and call only the device.
#pragma once
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "shoal/backend/device.h"
#include "shoal/core/process_identity.h"

namespace shoal::ipc::detail {

struct mapping;
struct context_holdings;

class left_open_imports {
 public:
  struct table_remains {
    backend::device* device = nullptr;
    process_identity producer;
    std::vector<std::shared_ptr<mapping>> mappings;  // each with a view still to be released
    std::vector<backend::imported_event_ref> sources;
  };
  /// Keeps `remains` until its mappings' views are gone. std::bad_alloc
  /// leaves them with the caller.
  void keep(table_remains&& remains);
  /// Closes the mappings no view uses any more, and a table's event sources
  /// once its mappings are all closed, giving their counts back to `held`.
  void close_released(context_holdings& held) noexcept;
  struct amount {
    std::size_t segments = 0;
    std::size_t bytes = 0;
  };
  /// What `producer`'s earlier tables left mapped here.
  [[nodiscard]] amount held_for(const process_identity& producer) const;

 private:
  mutable std::mutex mutex_;
  std::vector<table_remains> remains_;  // guarded by mutex_
};

}  // namespace shoal::ipc::detail
