// Test helpers for the caching allocator: a fixture per backend, or per
// backend and allocator configuration, and a few ways to look at what the
// allocator holds.
#pragma once

#include <memory>
#include <string>
#include <type_traits>

#include "shoal/alloc/caching_allocator.h"
#include "support/backends.h"

namespace shoal::testing {

// Allocator configurations the contract suites run under (a test axis): a
// name for test names, SHOAL_ALLOC_CONF text that goes before a test's own
// settings (so a test that sets a key itself wins), and what it turns on.
struct default_config {
  static constexpr const char* name = "default";
  static constexpr const char* conf = "";
  static constexpr bool expandable_segments = false, debug = false;
};
struct expandable_config {
  static constexpr const char* name = "expandable_segments";
  static constexpr const char* conf = "expandable_segments:true";
  static constexpr bool expandable_segments = true, debug = false;
};
struct debug_config {
  static constexpr const char* name = "debug";
  static constexpr const char* conf = "debug:true";
  static constexpr bool expandable_segments = false, debug = true;
};
// The same with cross-stream safety off (the stream suite's second axis).
struct default_unsafe_config {
  static constexpr const char* name = "default_unsafe";
  static constexpr const char* conf = "cross_stream_safety:false";
  static constexpr bool expandable_segments = false, debug = false;
};
struct expandable_unsafe_config {
  static constexpr const char* name = "expandable_segments_unsafe";
  static constexpr const char* conf = "expandable_segments:true,cross_stream_safety:false";
  static constexpr bool expandable_segments = true, debug = false;
};
struct debug_unsafe_config {
  static constexpr const char* name = "debug_unsafe";
  static constexpr const char* conf = "debug:true,cross_stream_safety:false";
  static constexpr bool expandable_segments = false, debug = true;
};

/// A typed-test parameter: a backend under an allocator configuration.
template <class Backend, class Config>
struct configured {
  using backend = Backend;
  using config = Config;
};
// Named types, so that ctest's names (which show the type) read
// suite.test<shoal::testing::host_expandable_segments>.
struct host_default : configured<host_backend, default_config> {};
struct host_expandable_segments : configured<host_backend, expandable_config> {};
struct host_debug : configured<host_backend, debug_config> {};
struct cuda_default : configured<cuda_backend, default_config> {};
struct cuda_expandable_segments : configured<cuda_backend, expandable_config> {};
struct cuda_debug : configured<cuda_backend, debug_config> {};
struct host_default_unsafe : configured<host_backend, default_unsafe_config> {};
struct host_expandable_segments_unsafe : configured<host_backend, expandable_unsafe_config> {};
struct host_debug_unsafe : configured<host_backend, debug_unsafe_config> {};
struct cuda_default_unsafe : configured<cuda_backend, default_unsafe_config> {};
struct cuda_expandable_segments_unsafe : configured<cuda_backend, expandable_unsafe_config> {};
struct cuda_debug_unsafe : configured<cuda_backend, debug_unsafe_config> {};

/// Every backend under every configuration.
using backend_config_types = ::testing::Types<host_default, host_expandable_segments, host_debug, cuda_default,
                                              cuda_expandable_segments, cuda_debug>;

/// The default configuration on every backend.
using default_config_types = ::testing::Types<host_default, cuda_default>;
/// The configurations with fixed segments (for tests of their layout).
using fixed_segment_config_types = ::testing::Types<host_default, host_debug, cuda_default, cuda_debug>;
/// Every backend under every configuration with cross-stream safety off.
using unsafe_config_types = ::testing::Types<host_default_unsafe, host_expandable_segments_unsafe, host_debug_unsafe,
                                             cuda_default_unsafe, cuda_expandable_segments_unsafe, cuda_debug_unsafe>;
/// Those without debug's checks (for tests of what happens when nothing
/// catches a mistake).
using unsafe_unchecked_config_types = ::testing::Types<host_default_unsafe, host_expandable_segments_unsafe,
                                                       cuda_default_unsafe, cuda_expandable_segments_unsafe>;
/// Every backend under every configuration, cross-stream safety on and off.
using both_safety_config_types =
    ::testing::Types<host_default, host_expandable_segments, host_debug, cuda_default, cuda_expandable_segments,
                     cuda_debug, host_default_unsafe, host_expandable_segments_unsafe, host_debug_unsafe,
                     cuda_default_unsafe, cuda_expandable_segments_unsafe, cuda_debug_unsafe>;

/// GoogleTest names: suite/host_default.test, suite/host_debug.test, ...
struct backend_config_names {
  template <class T>
  static std::string GetName(int) {
    return std::string(T::backend::name) + "_" + T::config::name;
  }
};

namespace detail {
// A plain backend parameter runs under the default configuration.
template <class Param>
struct param_parts {
  using backend = Param;
  using config = default_config;
};
template <class Param>
  requires requires { typename Param::config; }
struct param_parts<Param> {
  using backend = typename Param::backend;
  using config = typename Param::config;
};
}  // namespace detail

/// `Param` is a backend (host_backend, cuda_backend), which runs under the
/// default configuration, or one of the backend-and-configuration types above.
template <class Param>
class allocator_test : public backend_test<typename detail::param_parts<Param>::backend> {
 public:
  using backend_type = typename detail::param_parts<Param>::backend;
  using config_type = typename detail::param_parts<Param>::config;
  static constexpr bool on_host = std::is_same_v<backend_type, host_backend>;
  /// What the configuration turns on, for tests that hold only without it.
  static constexpr bool expandable_segments = config_type::expandable_segments;
  static constexpr bool debug = config_type::debug;

  /// The configuration's settings followed by `conf` (both SHOAL_ALLOC_CONF text).
  static std::string configured_text(const std::string& conf) {
    const std::string base = config_type::conf;
    if (base.empty()) return conf;
    return conf.empty() ? base : base + "," + conf;
  }

  /// A fresh allocator on the backend's device with the configuration's
  /// settings and then `conf` (SHOAL_ALLOC_CONF text).
  alloc::caching_allocator& make(const std::string& conf = "") {
    allocator_ = std::make_unique<alloc::caching_allocator>(this->device(),
                                                            alloc::allocator_config::parse(configured_text(conf)));
    return *allocator_;
  }

 protected:
  std::unique_ptr<alloc::caching_allocator> allocator_;
};

/// Segments in a snapshot, and blocks in a given state.
inline std::size_t count_blocks(const alloc::snapshot& s, alloc::block_state state) {
  std::size_t n = 0;
  for (const auto& seg : s.segments) {
    for (const auto& b : seg.blocks) n += b.state == state ? 1 : 0;
  }
  return n;
}

/// Every "current" statistic of blocks in use is zero.
inline ::testing::AssertionResult nothing_in_use(const alloc::allocator_stats& s) {
  for (const auto* stat : {&s.allocations, &s.active, &s.allocated_bytes, &s.active_bytes, &s.requested_bytes}) {
    if (stat->aggregate.current != 0) {
      return ::testing::AssertionFailure() << "a block statistic is still " << stat->aggregate.current << ": "
                                           << s.to_json();
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace shoal::testing
