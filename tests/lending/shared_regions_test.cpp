// Shared read-only regions on both backends: a writer publishes a region
// with its layout; reader processes map the same memory read-only and find
// every entry by name; a reader cannot write it (and a read-write mapping of
// the same handle can: the protection is the mapping's); a wrong hash is
// refused; malformed layouts are refused and hostile frames close only
// their sender; a killed reader's hold is reclaimed while the others keep
// the region; the region goes with its last holder.
//
// In-process borrowers run on the host backend only (CUDA refuses to import
// memory in the process that exported it); borrower processes run on both.
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <sstream>

#include "lending/lending_fixture.h"
#include "lending/messages.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"
#include "shoal/lending/borrower.h"
#include "shoal/lending/layout.h"

namespace shoal::testing {
namespace {

using lending::region_mode;

template <class Backend>
class shared_region_test : public lending_test<Backend> {
 protected:
  /// Starts a writer process that publishes `bytes` filled with `value`
  /// under `name`; returns it with the hash it committed.
  std::pair<std::unique_ptr<child_process>, std::string> writer(std::size_t bytes, const std::string& name,
                                                                int value) {
    auto child = this->borrower_process({"publish", std::to_string(bytes), name, std::to_string(value)});
    const std::string line = line_from(*child);
    EXPECT_EQ(line.rfind("published ", 0), 0u) << line;
    return {std::move(child), line.substr(line.rfind(' ') + 1)};
  }
  std::unique_ptr<child_process> reader(const std::string& name, const std::string& hash, int value) {
    return this->borrower_process({"read", name, hash, std::to_string(value)});
  }
};
TYPED_TEST_SUITE(shared_region_test, backend_types, backend_names);

/// The permissions column of /proc/self/maps for the mapping holding `p`.
std::string protection_of(const void* p) {
  std::ifstream maps("/proc/self/maps");
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  for (std::string line; std::getline(maps, line);) {
    std::istringstream fields(line);
    std::string range, permissions;
    fields >> range >> permissions;
    const auto dash = range.find('-');
    const auto low = std::stoull(range.substr(0, dash), nullptr, 16);
    const auto high = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (at >= low && at < high) return permissions;
  }
  return "not mapped";
}

TYPED_TEST(shared_region_test, a_published_region_is_mapped_by_several_processes_with_its_layout) {
  auto& l = this->start();
  auto [writer, hash] = this->writer(4 * mib, "model A", 0x5A);
  std::vector<std::unique_ptr<child_process>> readers;
  for (int i = 0; i < 3; ++i) readers.push_back(this->reader("model A", i == 0 ? "-" : hash, 0x5A));
  for (auto& r : readers) EXPECT_EQ(line_from(*r).rfind("read ", 0), 0u) << "a reader saw other bytes";
  const auto s = l.status();
  ASSERT_EQ(s.regions.size(), 1u);
  const auto& region = s.regions[0];
  EXPECT_EQ(region.mode, region_mode::shared);
  EXPECT_EQ(region.purpose, "model A");
  EXPECT_EQ(region.borrower.pid, writer->pid());
  ASSERT_EQ(region.holders.size(), 4u) << "the writer and three readers";
  EXPECT_EQ(region.holders[0].process.pid, writer->pid());
  EXPECT_EQ(s.lent_bytes, 4 * mib) << "one copy, counted once";
  EXPECT_EQ(s.published, 1u);
  const std::string text = l.metrics_text();
  EXPECT_NE(text.find("shoal_lending_shared_holds 4\n"), std::string::npos) << text;
  EXPECT_NE(text.find("mode=\"shared\",state=\"lent\",pid=\"" + std::to_string(writer->pid())), std::string::npos)
      << text;
  EXPECT_NE(text.find("shoal_lending_region_holds{id=\"" + std::to_string(region.id) + "\",pid=\"" +
                      std::to_string(readers[1]->pid()) + "\",state=\"lent\"} 1\n"),
            std::string::npos)
      << text;
}

TYPED_TEST(shared_region_test, a_reader_cannot_write_a_shared_region) {
  this->start();
  auto [writer, hash] = this->writer(2 * mib, "read only", 0x11);
  auto child = this->borrower_process({"write-shared", "read only", "read-only"});
  ASSERT_EQ(line_from(*child), "writing");
  const std::string after = line_from(*child);
  if (std::string(TypeParam::name) == "host") {
    EXPECT_EQ(after, "");
    EXPECT_EQ(child->wait(), 128 + SIGSEGV) << "the write through the read-only mapping did not fault";
  } else {
    EXPECT_EQ(after.rfind("error ", 0), 0u) << "the write through the read-only mapping went through: " << after;
  }
  auto check = this->reader("read only", hash, 0x11);
  EXPECT_EQ(line_from(*check).rfind("read ", 0), 0u) << "the region's bytes changed";
}

TYPED_TEST(shared_region_test, control_a_read_write_mapping_of_the_same_handle_writes) {
  this->start();
  auto [writer, hash] = this->writer(2 * mib, "mapped by hand", 0x11);
  auto child = this->borrower_process({"write-shared", "mapped by hand", "read-write"});
  ASSERT_EQ(line_from(*child), "writing");
  EXPECT_EQ(line_from(*child), "wrote") << "with the protection off the write goes through, so the test above "
                                           "shows the read-only mapping at work";
  auto check = this->reader("mapped by hand", hash, 0x11);
  EXPECT_EQ(line_from(*check).rfind("wrong", 0), 0u) << "the write did not land";
}

TYPED_TEST(shared_region_test, a_reader_expecting_another_hash_is_refused) {
  this->start();
  auto [writer, hash] = this->writer(2 * mib, "versioned", 0x22);
  std::string other = hash;
  other[0] = other[0] == '0' ? '1' : '0';
  auto refused = this->reader("versioned", other, 0x22);
  const std::string line = line_from(*refused);
  EXPECT_EQ(line.rfind("error the lender refused: region 'versioned' has content hash " + hash, 0), 0u) << line;
  EXPECT_EQ(refused->wait(), 1);
  auto unknown = this->reader("no such model", "-", 0x22);
  EXPECT_NE(line_from(*unknown).find("no region is published as 'no such model'"), std::string::npos);
}

TYPED_TEST(shared_region_test, a_killed_reader_is_reclaimed_and_the_region_stays_for_the_others) {
  auto& l = this->start();
  auto [writer, hash] = this->writer(2 * mib, "model B", 0x33);
  auto doomed = this->reader("model B", hash, 0x33);
  auto stays = this->reader("model B", hash, 0x33);
  ASSERT_EQ(line_from(*doomed).rfind("read ", 0), 0u);
  ASSERT_EQ(line_from(*stays).rfind("read ", 0), 0u);
  ASSERT_EQ(l.status().regions.at(0).holders.size(), 3u);
  ASSERT_EQ(::kill(doomed->pid(), SIGKILL), 0);
  EXPECT_EQ(doomed->wait(), 128 + SIGKILL);
  EXPECT_TRUE(eventually([&] {
    const auto s = l.status();
    return s.regions.size() == 1 && s.regions[0].holders.size() == 2 && s.reclaimed == 1;
  })) << "the killed reader's hold was not reclaimed";
  EXPECT_EQ(l.status().lent_bytes, 2 * mib);
  auto next = this->reader("model B", hash, 0x33);
  EXPECT_EQ(line_from(*next).rfind("read ", 0), 0u) << "the region did not stay for the others";
}

TYPED_TEST(shared_region_test, the_region_is_released_once_its_last_holder_gives_it_back) {
  auto& l = this->start();
  auto [writer, hash] = this->writer(2 * mib, "model C", 0x44);
  auto reader = this->reader("model C", hash, 0x44);
  ASSERT_EQ(line_from(*reader).rfind("read ", 0), 0u);
  ::shutdown(writer->socket(), SHUT_RDWR);  // the writer gives its hold back and exits
  EXPECT_EQ(writer->wait(), 0);
  ASSERT_TRUE(eventually([&] { return l.status().given_back == 1; }));
  auto s = l.status();
  ASSERT_EQ(s.regions.size(), 1u) << "released while a reader holds it";
  EXPECT_EQ(s.regions[0].holders.size(), 1u);
  EXPECT_EQ(s.regions[0].holders[0].process.pid, reader->pid());
  auto late = this->reader("model C", hash, 0x44);
  EXPECT_EQ(line_from(*late).rfind("read ", 0), 0u) << "published without its writer, still found by name";
  ::shutdown(reader->socket(), SHUT_RDWR);
  ::shutdown(late->socket(), SHUT_RDWR);
  EXPECT_EQ(reader->wait(), 0);
  EXPECT_EQ(late->wait(), 0);
  EXPECT_TRUE(eventually([&] { return l.status().regions.empty(); }));
  s = l.status();
  EXPECT_EQ(s.lent_bytes, 0u);
  EXPECT_EQ(s.given_back, 3u);
  EXPECT_EQ(s.reclaimed, 0u);
  EXPECT_NE(l.metrics_text().find("shoal_lending_shared_regions 0\n"), std::string::npos);
}

// ---- in-process (host backend) -------------------------------------------------

lending::region_layout layout_of(std::size_t bytes) {
  lending::region_layout layout;
  layout.entries = {{"weights", 0, bytes / 2, lending::dtype::float32, {bytes / 8}},
                    {"bias", bytes / 2, 1024, lending::dtype::float16, {2, 256}}};
  return layout;
}

TYPED_TEST(shared_region_test, the_writer_keeps_a_read_only_mapping_and_readers_find_entries_by_name) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  lending::borrower writer(dev, l.address()), reader(dev, l.address());
  auto region = writer.borrow(mib, "model D");
  EXPECT_EQ(protection_of(region.data()).substr(0, 3), "rw-");
  auto* floats = static_cast<float*>(region.data());
  for (std::size_t i = 0; i < mib / 8; ++i) floats[i] = static_cast<float>(i);
  auto layout = layout_of(region.size());
  layout.hash = lending::hash_entries(dev, region.data(), region.size(), layout);
  EXPECT_THROW((void)reader.borrow_shared("model D"), invalid_argument) << "found before it was published";
  region = writer.publish(std::move(region), layout);
  EXPECT_EQ(region.mode(), region_mode::shared);
  EXPECT_EQ(protection_of(region.data()).substr(0, 3), "r--") << "the writer can still write after publishing";
  auto shared = reader.borrow_shared("model D", layout.hash);
  EXPECT_EQ(shared.id(), region.id());
  EXPECT_EQ(protection_of(shared.data()).substr(0, 3), "r--");
  ASSERT_NE(shared.layout(), nullptr);
  EXPECT_EQ(shared.layout()->hash, layout.hash);
  EXPECT_EQ(shared.layout()->at("bias").shape, (std::vector<std::uint64_t>{2, 256}));
  EXPECT_EQ(static_cast<const float*>(shared.address_of("weights"))[1000], 1000.0f);
  EXPECT_EQ(static_cast<const std::byte*>(shared.address_of("bias")),
            static_cast<const std::byte*>(shared.data()) + shared.size() / 2);
  EXPECT_THROW((void)shared.address_of("nope"), invalid_argument);
  EXPECT_EQ(lending::hash_entries(dev, shared.data(), shared.size(), *shared.layout()), layout.hash);
  EXPECT_THROW((void)reader.publish(std::move(shared), layout), invalid_argument) << "published twice";
}

TYPED_TEST(shared_region_test, publishing_is_refused_for_bad_layouts_taken_names_and_others_regions) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  lending::borrower a(dev, l.address()), b(dev, l.address());
  auto region = a.borrow(mib, "model E");
  auto bad = layout_of(region.size());
  bad.entries[1].offset = 8;  // overlaps "weights"
  EXPECT_THROW(region = a.publish(std::move(region), bad), invalid_argument);
  EXPECT_TRUE(region.valid()) << "a layout refused before sending leaves the region as it was";
  EXPECT_THROW(region = b.publish(std::move(region), layout_of(mib)), invalid_argument) << "another's region";
  EXPECT_TRUE(region.valid());
  auto first = a.publish(std::move(region), layout_of(mib));
  auto second = b.borrow(mib, "model E");
  try {
    (void)b.publish(std::move(second), layout_of(mib));
    ADD_FAILURE() << "a second region was published under a name in use";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("is published as 'model E' already"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(eventually([&] { return l.status().regions.size() == 1; })) << "the refused region was not given back";
  EXPECT_THROW(l.revoke(first.id(), std::chrono::milliseconds(100)), invalid_argument) << "a shared region revoked";
}

TYPED_TEST(shared_region_test, a_readers_quota_counts_the_shared_bytes_in_full) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start({.capacity_bytes = 8 * mib, .quota_bytes = 3 * mib});
  lending::borrower writer(dev, l.address()), reader(dev, l.address());
  auto published = writer.publish(writer.borrow(2 * mib, "model F"), layout_of(2 * mib));
  auto held = reader.borrow(2 * mib, "its own");
  EXPECT_THROW((void)reader.borrow_shared("model F"), peer_refused);
  reader.give_back(std::move(held));
  auto shared = reader.borrow_shared("model F");
  EXPECT_THROW((void)reader.borrow(2 * mib, "past the quota"), peer_refused);
  EXPECT_EQ(l.status().lent_bytes, 2 * mib);
}

TYPED_TEST(shared_region_test, a_reader_that_names_the_writers_uid_refuses_a_region_another_uid_published) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  lending::borrower writer(dev, l.address()), reader(dev, l.address());
  auto published = writer.publish(writer.borrow(mib, "model W"), layout_of(mib));
  const uid_t mine = ::geteuid();
  const uid_t other = mine + 1;  // the uid a reader trusts when another uid took the name first
  try {
    (void)reader.borrow_shared("model W", std::nullopt, other);
    ADD_FAILURE() << "a region published by uid " << mine << " was lent to a reader expecting uid " << other;
  } catch (const content_mismatch& e) {
    EXPECT_NE(std::string(e.what()).find("published by uid " + std::to_string(mine)), std::string::npos) << e.what();
  }
  EXPECT_EQ(l.status().regions.at(0).holders.size(), 1u) << "the refused reader holds nothing";
  auto shared = reader.borrow_shared("model W", published.layout()->hash, mine);
  EXPECT_EQ(shared.id(), published.id());
}

TYPED_TEST(shared_region_test, malformed_publish_and_shared_borrow_frames_close_only_their_sender) {
  if (this->in_process_only()) return;
  auto& dev = this->device();
  auto& l = this->start();
  lending::borrower good(dev, l.address());
  auto kept = good.publish(good.borrow(mib, "model G"), layout_of(mib));
  using lending::detail::message_type;
  const auto connect = [&] {
    auto raw = channel::connection::connect(l.address(), {}, lending::detail::max_frame_payload);
    channel::send_hello(raw, lending::detail::lending_protocol);
    (void)raw.receive_for(std::chrono::milliseconds(2000));
    return raw;
  };
  // A layout that decodes but does not fit its region: refused, the connection kept.
  {
    auto raw = connect();
    raw.send(static_cast<std::uint16_t>(message_type::borrow),
             lending::detail::encode(lending::detail::borrow_message{1, mib, region_mode::exclusive, "model H"}));
    const auto lent = lending::detail::decode_lent(raw.receive_for(std::chrono::milliseconds(2000)).payload);
    (void)raw.receive_for(std::chrono::milliseconds(2000));  // its chunk
    auto overlapping = layout_of(mib);
    overlapping.entries[1].offset = 0;
    raw.send(static_cast<std::uint16_t>(message_type::publish),
             lending::detail::encode(lending::detail::publish_message{2, lent.region, overlapping}));
    const auto answer = raw.receive_for(std::chrono::milliseconds(2000));
    ASSERT_EQ(answer.type, static_cast<std::uint16_t>(message_type::refused));
    EXPECT_NE(lending::detail::decode_refused(answer.payload).why.find("overlap"), std::string::npos);
    raw.send(static_cast<std::uint16_t>(message_type::publish),
             lending::detail::encode(lending::detail::publish_message{3, 999, layout_of(mib)}));
    EXPECT_EQ(raw.receive_for(std::chrono::milliseconds(2000)).type, static_cast<std::uint16_t>(message_type::refused))
        << "a region it does not hold";
  }
  // Frames that do not decode: closed.
  auto bad_dtype = lending::detail::encode(lending::detail::publish_message{1, kept.id(), layout_of(mib)});
  bad_dtype[8 + 8 + 32 + 4 + 4 + 7 + 8 + 8] = std::byte{77};  // the first entry's dtype ("weights": 7 bytes)
  auto bad_count = lending::detail::encode(lending::detail::layout_message{1, layout_of(mib)});
  auto bad_flag = lending::detail::encode(lending::detail::borrow_shared_message{1, "model G", {}});
  bad_flag.back() = std::byte{2};
  const std::vector<std::pair<message_type, std::vector<std::byte>>> attacks{
      {message_type::publish, bad_dtype},
      {message_type::layout, bad_count},  // a lender's message
      {message_type::borrow_shared, bad_flag},
      {message_type::borrow_shared, std::vector<std::byte>(5)},
      {message_type::borrow, lending::detail::encode(lending::detail::borrow_message{1, mib, region_mode::shared, "x"})},
  };
  for (const auto& [type, payload] : attacks) {
    auto raw = connect();
    raw.send(static_cast<std::uint16_t>(type), payload);
    EXPECT_THROW((void)raw.receive_for(std::chrono::milliseconds(2000)), connection_closed)
        << "frame type " << static_cast<int>(type) << " was not refused";
  }
  EXPECT_TRUE(eventually([&] { return l.status().connections_closed_for_errors == attacks.size(); }));
  auto again = good.borrow_shared("model G");
  EXPECT_EQ(again.id(), kept.id()) << "the good borrower is still served";
  const auto s = l.status();
  ASSERT_EQ(s.regions.size(), 2u);
  EXPECT_EQ(s.regions[1].purpose, "model H");
  EXPECT_EQ(s.regions[1].state, lending::region_state::orphaned) << "its borrower hung up alive";
}

}  // namespace
}  // namespace shoal::testing
