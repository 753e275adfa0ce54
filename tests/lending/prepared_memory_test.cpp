// Where the lender's memory comes from: prepared chunks made when it starts
// (lent first, with no device call at borrow time, to a borrower of any
// uid, counted against the capacity and released after the spares when a
// region of another size needs the room), and a device that refuses a fresh
// chunk (every spare and the unused prepared chunks released, the chunk
// tried once more, then a typed refusal).
//
// In-process borrowers run on the host backend only (CUDA refuses to import
// memory in the process that exported it); borrower processes run on both.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "lending/counting_device.h"
#include "lending/lending_fixture.h"
#include "shoal/backend/host_device.h"
#include "shoal/core/error.h"
#include "support/other_uids.h"

namespace shoal::testing {
namespace {

template <class Backend>
using prepared_memory_test = lending_test<Backend>;
TYPED_TEST_SUITE(prepared_memory_test, backend_types, backend_names);

/// The memory ids a `cycle` borrower process said it was lent ("cycled <id>,<id>... imports <n> kept <n>").
std::vector<std::uint64_t> cycled_memory(const std::string& line) {
  std::istringstream in(line);
  std::string word, ids;
  in >> word >> ids;
  std::vector<std::uint64_t> memory;
  if (word != "cycled") return memory;
  std::istringstream list(ids);
  for (std::string id; std::getline(list, id, ',');) memory.push_back(std::stoull(id));
  return memory;
}

std::vector<std::uint64_t> cycle(const char* backend, const std::string& address, std::size_t bytes, int rounds,
                                 const char* as) {
  child_process child(SHOAL_TEST_BORROWER, std::vector<std::string>{"cycle", backend, address, std::to_string(bytes),
                                                                    std::to_string(rounds), as});
  return cycled_memory(line_from(child));
}

TYPED_TEST(prepared_memory_test, prepared_chunks_are_made_at_start_and_lent_with_no_device_call) {
  counting_device lender_device(this->device());
  lender l(lender_device, channel::channel_address::at_path(this->socket_path()),
           {.prepared_chunks = {2 * mib, 2 * mib}});
  ASSERT_EQ(lender_device.chunks_made.load(), 2);
  ASSERT_EQ(lender_device.exports.load(), 2);
  auto s = l.status();
  EXPECT_EQ(s.prepared_bytes, 4 * mib);
  EXPECT_EQ(s.prepared_chunks, 2u);
  EXPECT_EQ(s.chunks_made, 2u);

  const auto memory = cycle(TypeParam::name, this->socket_path(), 2 * mib, 1, "self");
  ASSERT_EQ(memory.size(), 1u);
  EXPECT_LE(memory[0], 2u) << "not one of the two prepared chunks";
  EXPECT_EQ(lender_device.chunks_made.load(), 2) << "a chunk was made at borrow time";
  EXPECT_EQ(lender_device.exports.load(), 2) << "a chunk was exported at borrow time";
  s = l.status();
  EXPECT_EQ(s.prepared_used, 1u);
  EXPECT_EQ(s.prepared_bytes, 2 * mib);
  EXPECT_EQ(s.spare_bytes, 2 * mib) << "given back, it is an ordinary spare";
  EXPECT_NE(l.metrics_text().find("shoal_lending_prepared_bytes " + std::to_string(2 * mib) + "\n"),
            std::string::npos);
}

TYPED_TEST(prepared_memory_test, a_prepared_chunk_goes_to_any_uid_and_once_lent_to_that_uid_only) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "making a borrower of another uid (setresuid to 65534) needs root and the uid mapped";
  const std::string name = "shoal-prepared-test-" + std::to_string(::getpid());
  constexpr uid_t nobody = 65534;
  lender l(this->device(), channel::channel_address::abstract(name),
           {.prepared_chunks = {2 * mib}, .policy = channel::access_policy{{nobody}, {}}});
  const auto other = cycle(TypeParam::name, "@" + name, 2 * mib, 1, "nobody");
  ASSERT_EQ(other.size(), 1u);
  EXPECT_EQ(other[0], 1u) << "uid 65534 was not lent the prepared chunk";
  const auto root = cycle(TypeParam::name, "@" + name, 2 * mib, 1, "self");
  ASSERT_EQ(root.size(), 1u);
  EXPECT_NE(root[0], other[0]) << "uid 0 was lent memory uid 65534 had mapped";
  const auto s = l.status();
  EXPECT_EQ(s.prepared_used, 1u);
  EXPECT_EQ(s.chunks_made, 2u);
}

TYPED_TEST(prepared_memory_test, prepared_bytes_count_against_the_capacity_and_make_room_after_the_spares) {
  if (this->in_process_only()) return;
  const std::size_t unit = this->unit();
  counting_device lender_device(this->device());
  lender l(lender_device, channel::channel_address::at_path(this->socket_path()),
           {.capacity_bytes = 6 * unit, .prepared_chunks = {2 * unit, 2 * unit}});
  EXPECT_NE(l.metrics_text().find("shoal_lending_free_bytes " + std::to_string(2 * unit) + "\n"), std::string::npos)
      << "6 units, 4 of them prepared";
  borrower b(this->device(), l.address(), {}, borrower::default_timeout, {.keep_mappings = false});
  auto from_prepared = b.borrow(2 * unit, "prepared");
  auto s = l.status();
  EXPECT_EQ(s.lent_bytes, 2 * unit);
  EXPECT_EQ(s.prepared_bytes, 2 * unit);
  // 2 lent + 5 > 6 even without the prepared chunk: refused, and it stays.
  EXPECT_THROW((void)b.borrow(5 * unit, "past the capacity anyway"), out_of_memory);
  EXPECT_EQ(l.status().prepared_chunks, 1u) << "a prepared chunk was released for a region that could not fit";
  // 2 lent + 2 prepared + 3 > 6: the prepared chunk not lent goes.
  auto fresh = b.borrow(3 * unit, "another size");
  s = l.status();
  EXPECT_EQ(s.lent_bytes, 5 * unit);
  EXPECT_EQ(s.prepared_bytes, 0u);
  EXPECT_EQ(s.prepared_chunks, 0u);
  EXPECT_LE(s.lent_bytes + s.spare_bytes + s.prepared_bytes, s.capacity_bytes);
  EXPECT_EQ(lender_device.chunks_made.load(), 3);
  EXPECT_THROW((void)b.borrow(2 * unit, "past the capacity"), out_of_memory);
}

TYPED_TEST(prepared_memory_test, prepared_chunks_past_the_capacity_are_refused_at_start) {
  const std::size_t unit = this->unit();
  const auto address = channel::channel_address::at_path(this->socket_path());
  EXPECT_THROW(lender(this->device(), address, {.capacity_bytes = 4 * unit, .prepared_chunks = {2 * unit, 3 * unit}}),
               invalid_argument);
  EXPECT_THROW(lender(this->device(), address, {.capacity_bytes = 4 * unit, .prepared_chunks = {0}}),
               invalid_argument);
  // Rounded up to the granularity: 4 units of one byte each pass 3 units.
  EXPECT_THROW(lender(this->device(), address, {.capacity_bytes = 3 * unit, .prepared_chunks = {1, 1, 1, 1}}),
               invalid_argument);
}

// A device with less memory than the lender's capacity (other processes use
// the rest): host only, where the device's size can be set. Four granules.
constexpr std::size_t granule = std::size_t{2} << 20;  // the host backend's granularity

class device_refusal_test : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(device_.granularity(), granule); }

  backend::host_device device_{{.capacity_bytes = 4 * granule}};
  temp_dir dir_;
  channel::channel_address address_ = channel::channel_address::at_path(dir_ / "lender.sock");
  lending::borrower_options no_kept_mappings_{.keep_mappings = false};
  lender_config config_{.capacity_bytes = 16 * granule};
};

TEST_F(device_refusal_test, a_refused_fresh_chunk_releases_every_spare_and_is_tried_once_more) {
  event_recorder log;
  log.attach(config_);
  lender l(device_, address_, config_);
  borrower b(device_, address_, {}, borrower::default_timeout, no_kept_mappings_);
  b.give_back(b.borrow(granule, "first spare"));
  b.give_back(b.borrow(2 * granule, "second spare"));
  ASSERT_EQ(l.status().spare_bytes, 3 * granule);
  // One granule left on the device; the lender's capacity would allow more.
  auto big = b.borrow(3 * granule, "needs the spares' memory");
  auto s = l.status();
  EXPECT_EQ(s.spare_bytes, 0u) << "every spare released";
  EXPECT_EQ(s.lent_bytes, 3 * granule);
  std::lock_guard lock(*log.guard);
  EXPECT_EQ(std::count_if(log.events->begin(), log.events->end(),
                          [](const lending::lender_event& e) {
                            return e.what == lending::lender_event::kind::spare_released;
                          }),
            2);
}

TEST_F(device_refusal_test, a_refused_fresh_chunk_releases_unused_prepared_chunks_then_is_a_typed_refusal) {
  config_.prepared_chunks = {granule, granule, granule};
  lender l(device_, address_, config_);
  borrower b(device_, address_, {}, borrower::default_timeout, no_kept_mappings_);
  // One granule left on the device: two prepared chunks make room.
  auto big = b.borrow(2 * granule, "needs prepared memory");
  EXPECT_EQ(l.status().prepared_chunks, 1u) << "only as many prepared bytes as the region's are released";
  EXPECT_THROW((void)b.borrow(3 * granule, "more than the device has"), out_of_memory);
  EXPECT_EQ(l.status().prepared_chunks, 0u) << "released when the device refused";
  auto small = b.borrow(granule, "what is left");  // the connection stays usable
  EXPECT_EQ(l.status().prepared_used, 0u);
}

}  // namespace
}  // namespace shoal::testing
