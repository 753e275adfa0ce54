// A list of weak references to objects that come and go with connections,
// swept of expired ones as it grows, so a long-lived owner serving many
// short connections stays flat:
//   entries <= 2 * max(live entries at the last sweep, 16)   (after any add)
//
// Thread-safety: none; its owner's mutex guards it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <vector>

namespace shoal::ipc::detail {

/// Weak references to objects that come and go with connections, swept of
/// expired ones as it grows (not thread-safe: its owner's mutex guards it).
template <class T>
class weak_list {
 public:
  void add(const std::shared_ptr<T>& item) {
    if (items_.size() >= 2 * swept_size_) sweep();
    items_.push_back(item);
  }
  /// add(), unless `item` is there already (O(entries)).
  void add_unique(const std::shared_ptr<T>& item) {
    for (const auto& w : items_) {
      if (!w.owner_before(item) && !item.owner_before(w)) return;
    }
    add(item);
  }
  /// The live ones; sweeps the rest.
  std::vector<std::shared_ptr<T>> live() {
    sweep();
    std::vector<std::shared_ptr<T>> out;
    for (auto& w : items_) {
      if (auto p = w.lock()) out.push_back(std::move(p));
    }
    return out;
  }
  [[nodiscard]] std::size_t size() const noexcept { return items_.size(); }

 private:
  void sweep() {
    std::erase_if(items_, [](const std::weak_ptr<T>& w) { return w.expired(); });
    swept_size_ = std::max<std::size_t>(items_.size(), 16);
  }
  std::vector<std::weak_ptr<T>> items_;
  std::size_t swept_size_ = 16;
};

}  // namespace shoal::ipc::detail
