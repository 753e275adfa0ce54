// Memory reuse on both backends: a given-back region's chunk is lent again
// to a later region of the same size and uid (the same memory id, no chunk
// made), a borrower's kept mapping is used again (no import); a borrower of
// another uid never gets a chunk another uid had; reuse = never is the
// control (fresh memory every time); capacity pressure releases spares and
// their keepers forget them; a SIGKILLed borrower's kept mappings are
// forgotten by the lender; hostile frames about memory are protocol errors.
//
// In-process borrowers run on the host backend only (CUDA refuses to import
// memory in the process that exported it); borrower processes run on both.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "lending/counting_device.h"
#include "lending/lending_fixture.h"
#include "lending/messages.h"
#include "lending/spare_pool.h"
#include "shoal/channel/protocol.h"
#include "shoal/core/error.h"
#include "shoal/lending/layout.h"
#include "support/other_uids.h"

namespace shoal::testing {
namespace {

template <class Backend>
using memory_reuse_test = lending_test<Backend>;
TYPED_TEST_SUITE(memory_reuse_test, backend_types, backend_names);

/// What a `cycle` borrower process said: "cycled <id>,<id>... imports <n> kept <n>".
struct cycled {
  std::vector<std::uint64_t> memory;
  int imports = -1;
  int kept = -1;
};

cycled parse_cycled(const std::string& line) {
  cycled c;
  std::istringstream in(line);
  std::string word, ids;
  in >> word >> ids;
  if (word != "cycled") return c;
  std::istringstream list(ids);
  for (std::string id; std::getline(list, id, ',');) c.memory.push_back(std::stoull(id));
  in >> word >> c.imports >> word >> c.kept;
  return c;
}

std::unique_ptr<child_process> cycle_process(const char* backend, const std::string& address, std::size_t bytes,
                                             int rounds, const char* as) {
  return std::make_unique<child_process>(
      SHOAL_TEST_BORROWER,
      std::vector<std::string>{"cycle", backend, address, std::to_string(bytes), std::to_string(rounds), as});
}

TYPED_TEST(memory_reuse_test, a_reborrow_in_another_process_gets_the_same_memory_and_its_kept_mapping) {
  counting_device lender_device(this->device());
  lender l(lender_device, channel::channel_address::at_path(this->socket_path()), {});
  auto child = cycle_process(TypeParam::name, this->socket_path(), 2 * mib, 3, "self");
  const std::string line = line_from(*child);
  const auto c = parse_cycled(line);
  ASSERT_EQ(c.memory.size(), 3u) << line;
  EXPECT_EQ(c.memory[1], c.memory[0]) << "the second borrow got other memory";
  EXPECT_EQ(c.memory[2], c.memory[0]);
  EXPECT_EQ(c.imports, 1) << "a re-borrow imported the memory again instead of using the kept mapping";
  EXPECT_EQ(c.kept, 1);
  EXPECT_EQ(lender_device.chunks_made.load(), 1);
  const auto s = l.status();
  EXPECT_EQ(s.chunks_made, 1u);
  EXPECT_EQ(s.reuses, 2u);
  EXPECT_EQ(s.kept_mappings_used, 2u);
  EXPECT_EQ(s.lent_bytes, 0u);
  EXPECT_EQ(s.spare_bytes, 2 * mib);
  ASSERT_EQ(s.spares.size(), 1u);
  EXPECT_EQ(s.spares[0].memory, c.memory[0]);
  EXPECT_EQ(s.spares[0].kept_by, 1u);
  EXPECT_EQ(s.spares[0].uid, ::geteuid());
  const std::string metrics = l.metrics_text();
  EXPECT_NE(metrics.find("shoal_lending_spare_bytes " + std::to_string(2 * mib)), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("shoal_lending_reuses_total 2"), std::string::npos);
  EXPECT_NE(metrics.find("shoal_lending_forgets_total 0"), std::string::npos);
  EXPECT_NE(metrics.find("shoal_lending_spare_chunk_bytes{memory=\"" + std::to_string(c.memory[0]) + "\",uid=\"" +
                         std::to_string(::geteuid()) + "\",kept_by=\"1\"} " + std::to_string(2 * mib)),
            std::string::npos)
      << metrics;
}

TYPED_TEST(memory_reuse_test, a_kept_mapping_comes_back_at_the_same_address_with_its_content_and_no_import) {
  if (this->in_process_only()) return;
  counting_device lender_device(this->device()), borrower_device(this->device());
  lender l(lender_device, channel::channel_address::at_path(this->socket_path()), {});
  borrower b(borrower_device, l.address());
  auto first = b.borrow(3 * mib, "first");
  const void* at = first.data();
  const auto memory = first.memory_id();
  const auto first_id = first.id();
  const auto size = first.size();
  this->device().fill({}, first.data(), 0x5A, first.size());
  this->device().synchronize({});
  b.give_back(std::move(first));
  EXPECT_EQ(b.kept().count, 1u);
  EXPECT_EQ(b.kept().bytes, size);
  EXPECT_EQ(borrower_device.imports_closed.load(), 0) << "the mapping was not kept";
  auto again = b.borrow(3 * mib, "again");
  EXPECT_NE(again.id(), first_id) << "a region id is never reused";
  EXPECT_EQ(again.memory_id(), memory);
  EXPECT_EQ(again.data(), at);
  EXPECT_TRUE(all_equal(this->read(again.data(), again.size()), 0x5A)) << "not the kept mapping's memory";
  EXPECT_EQ(borrower_device.imports.load(), 1);
  EXPECT_EQ(b.kept().count, 0u) << "the kept mapping is the region's now";
  auto other_size = b.borrow(5 * mib, "another size");
  EXPECT_NE(other_size.memory_id(), memory) << "a spare goes only to its own size";
  EXPECT_EQ(lender_device.chunks_made.load(), 2);
  EXPECT_EQ(l.status().kept_mappings_used, 1u);
}

TYPED_TEST(memory_reuse_test, control_with_reuse_never_every_region_is_fresh_memory) {
  if (this->in_process_only()) return;
  counting_device lender_device(this->device()), borrower_device(this->device());
  lender l(lender_device, channel::channel_address::at_path(this->socket_path()),
           {.reuse = lending::reuse_policy::never});
  borrower b(borrower_device, l.address());
  std::vector<std::uint64_t> memories;
  for (int round = 0; round < 3; ++round) {
    auto r = b.borrow(2 * mib, "fresh");
    memories.push_back(r.memory_id());
    b.give_back(std::move(r));
  }
  EXPECT_NE(memories[0], memories[1]);
  EXPECT_NE(memories[1], memories[2]);
  EXPECT_EQ(lender_device.chunks_made.load(), 3);
  EXPECT_EQ(borrower_device.imports.load(), 3);
  EXPECT_EQ(borrower_device.imports_closed.load(), 3) << "a mapping was kept although the lender does not reuse";
  EXPECT_EQ(b.kept().count, 0u);
  const auto s = l.status();
  EXPECT_TRUE(s.spares.empty());
  EXPECT_EQ(s.spare_bytes, 0u);
  EXPECT_EQ(s.reuses, 0u);
}

TYPED_TEST(memory_reuse_test, a_borrower_that_keeps_no_mappings_gets_the_spare_with_its_chunk) {
  if (this->in_process_only()) return;
  counting_device lender_device(this->device()), borrower_device(this->device());
  lender l(lender_device, channel::channel_address::at_path(this->socket_path()), {});
  borrower b(borrower_device, l.address(), {}, borrower::default_timeout, {.keep_mappings = false});
  auto r = b.borrow(2 * mib, "first");
  const auto memory = r.memory_id();
  b.give_back(std::move(r));
  EXPECT_EQ(b.kept().count, 0u);
  auto again = b.borrow(2 * mib, "again");
  EXPECT_EQ(again.memory_id(), memory);
  EXPECT_EQ(borrower_device.imports.load(), 2) << "imported again: it kept no mapping";
  EXPECT_EQ(lender_device.chunks_made.load(), 1);
  EXPECT_EQ(l.status().kept_mappings_used, 0u);
}

TYPED_TEST(memory_reuse_test, capacity_pressure_releases_spares_and_their_keepers_forget_them) {
  if (this->in_process_only()) return;
  const std::size_t unit = this->unit();
  counting_device a_device(this->device());
  event_recorder log;
  lender_config config{.capacity_bytes = 4 * unit};
  log.attach(config);
  auto& l = this->start(config);
  borrower a(a_device, l.address()), b(this->device(), l.address());
  a.give_back(a.borrow(2 * unit, "becomes spare"));
  ASSERT_EQ(a.kept().count, 1u);
  ASSERT_EQ(l.status().spare_bytes, 2 * unit);
  auto big = b.borrow(3 * unit, "needs the room");  // 3 + 2 spare > 4: the spare goes
  auto s = l.status();
  EXPECT_EQ(s.spare_bytes, 0u);
  EXPECT_TRUE(s.spares.empty());
  EXPECT_EQ(s.lent_bytes, 3 * unit);
  EXPECT_EQ(s.forgets, 1u);
  EXPECT_EQ(a.kept().count, 1u) << "an idle borrower reads the forget only when it next talks to the lender";
  EXPECT_TRUE(a.revocations(std::chrono::milliseconds(200)).empty());
  EXPECT_EQ(a.kept().count, 0u) << "the forget was read and the mapping not dropped";
  EXPECT_EQ(a_device.imports_closed.load(), 1);
  EXPECT_THROW((void)b.borrow(2 * unit, "past the capacity"), out_of_memory) << "no spare left to release";
  std::lock_guard lock(*log.guard);
  EXPECT_TRUE(std::any_of(log.events->begin(), log.events->end(), [](const lending::lender_event& e) {
    return e.what == lending::lender_event::kind::spare_released;
  }));
}

// What the lender's books say a connection maps: the regions lent and the
// spares it keeps mapped (the only connection that keeps any).
std::size_t mapped_by_the_one_keeper(const lending::lender_status& s) {
  std::size_t bytes = s.lent_bytes;
  for (const auto& spare : s.spares) bytes += spare.kept_by > 0 ? spare.bytes : 0;
  return bytes;
}

// The attack: borrow, give back keeping the mapping, borrow another size,
// again and again. Kept mappings count against the quota, so a borrow that
// needs the room has the lender drop older kept mappings (forget) first: the
// borrower never maps more than its quota, by the lender's books or its own
// (without it, 60 MiB kept and 4 MiB lent under a quota of 16).
TYPED_TEST(memory_reuse_test, a_borrower_cycling_sizes_with_kept_mappings_never_maps_past_its_quota) {
  if (this->in_process_only()) return;
  auto& l = this->start({.capacity_bytes = 64 * mib, .quota_bytes = 16 * mib});
  borrower b(this->device(), l.address());
  for (const std::size_t size : {16 * mib, 14 * mib, 12 * mib, 10 * mib, 8 * mib, 4 * mib}) {
    auto r = b.borrow(size, "cycling sizes");
    EXPECT_LE(mapped_by_the_one_keeper(l.status()), 16 * mib) << "lent " << size << " past the quota";
    EXPECT_LE(b.kept().bytes + r.size(), 16 * mib) << "the borrower maps past its quota";
    b.give_back(std::move(r));
  }
  auto s = l.status();
  EXPECT_EQ(s.forgets, 4u) << "each borrow from 14 to 8 MiB drops the mapping kept before it; 8 + 4 fit";
  EXPECT_EQ(s.spare_bytes, 64 * mib) << "the spares stay, kept mapped no more";
  EXPECT_EQ(b.kept().bytes, 12 * mib);
  auto again = b.borrow(4 * mib, "the kept one again");
  auto rest = b.borrow(12 * mib, "the room of the 8 MiB kept mapping");
  s = l.status();
  EXPECT_EQ(s.forgets, 5u);
  EXPECT_EQ(s.kept_mappings_used, 1u);
  EXPECT_EQ(s.lent_bytes, 16 * mib);
  EXPECT_EQ(b.kept().bytes, 0u);
  EXPECT_THROW((void)b.borrow(2 * mib, "past the quota"), peer_refused);
}

// A borrow that would not fit even with every mapping its borrower keeps
// dropped is refused, and drops none; the refusal says what is kept.
TYPED_TEST(memory_reuse_test, a_borrow_that_dropping_every_kept_mapping_would_not_fit_is_refused_and_drops_none) {
  if (this->in_process_only()) return;
  auto& l = this->start({.capacity_bytes = 64 * mib, .quota_bytes = 16 * mib});
  borrower b(this->device(), l.address());
  auto held = b.borrow(12 * mib, "held");
  b.give_back(b.borrow(4 * mib, "kept"));
  try {
    (void)b.borrow(8 * mib, "past the quota however much is dropped");
    ADD_FAILURE() << "lent past the quota";
  } catch (const peer_refused& e) {
    EXPECT_NE(std::string(e.what()).find("keeps " + std::to_string(4 * mib) + " more mapped"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(l.status().forgets, 0u);
  EXPECT_EQ(b.kept().bytes, 4 * mib);
  EXPECT_NO_THROW(b.give_back(b.borrow(4 * mib, "the kept one again"))) << "its kept mapping fits as it is";
  EXPECT_EQ(l.status().kept_mappings_used, 1u);
}

// Kept mappings are dropped for a borrow's room only when it is lent (the
// cycling test above): a borrow that waits for capacity and runs out, or is
// refused because others wait, leaves them mapped (a drop costs its keeper
// a re-map).
TYPED_TEST(memory_reuse_test, a_borrow_that_waits_in_vain_or_is_refused_drops_no_kept_mapping) {
  if (this->in_process_only()) return;
  auto& l = this->start({.capacity_bytes = 32 * mib, .quota_bytes = 24 * mib});
  borrower b(this->device(), l.address());
  borrower other(this->device(), l.address());
  borrower waiter(this->device(), l.address());
  auto held = b.borrow(12 * mib, "held");
  b.give_back(b.borrow(4 * mib, "kept"));
  auto rest = other.borrow(16 * mib, "the capacity's rest");  // lent 28 of 32, the 4 MiB spare beside it
  // 12 held + 4 kept + 10 pass the quota of 24 unless the 4 go; 28 + 10 pass the capacity.
  EXPECT_THROW((void)b.borrow(10 * mib, "waits and runs out", lending::borrow_wait{.for_memory = 50ms}),
               lending::memory_refused);
  EXPECT_EQ(l.status().forgets, 0u) << "dropped a kept mapping for a borrow that waited in vain";
  EXPECT_EQ(b.kept().bytes, 4 * mib);
  auto waits = std::async(std::launch::async, [&] {
    return waiter.borrow(10 * mib, "waits for the capacity", lending::borrow_wait{.for_memory = 10s});
  });
  ASSERT_TRUE(eventually([&] { return l.status().waiting.size() == 1; }));
  EXPECT_THROW((void)b.borrow(10 * mib, "others wait ahead"), lending::memory_refused);
  EXPECT_EQ(l.status().forgets, 0u) << "dropped a kept mapping for a borrow refused because others wait";
  EXPECT_EQ(b.kept().bytes, 4 * mib);
  other.give_back(std::move(rest));
  EXPECT_EQ(waits.get().size(), 10 * mib);
}

// A spare two connections of one uid keep mapped counts once for the uid
// (and in full for each connection); when the uid's quota needs its room,
// both are told to forget it.
TYPED_TEST(memory_reuse_test, a_spare_two_connections_keep_mapped_counts_once_for_their_uid_and_both_forget_it) {
  if (this->in_process_only()) return;
  auto& l = this->start({.capacity_bytes = 64 * mib, .quota_bytes = 16 * mib, .quota_bytes_per_uid = 16 * mib});
  borrower a(this->device(), l.address()), c(this->device(), l.address());
  a.give_back(a.borrow(16 * mib, "first"));
  auto r = c.borrow(16 * mib, "the same memory");  // a's kept spare: the uid maps nothing more
  EXPECT_EQ(l.status().forgets, 0u);
  c.give_back(std::move(r));
  ASSERT_EQ(l.status().spares.size(), 1u);
  ASSERT_EQ(l.status().spares[0].kept_by, 2u);
  auto small = a.borrow(4 * mib, "another size");
  EXPECT_TRUE(c.revocations(200ms).empty());
  EXPECT_EQ(a.kept().count, 0u);
  EXPECT_EQ(c.kept().count, 0u) << "the uid maps 20 MiB under a quota of 16";
  const auto s = l.status();
  EXPECT_EQ(s.forgets, 2u);
  ASSERT_EQ(s.spares.size(), 1u);
  EXPECT_EQ(s.spares[0].kept_by, 0u);
}

// A kept mapping of memory lent to another connection of the uid still
// counts for its keeper: the keeper's next borrow that needs the room has
// it forgotten first.
TYPED_TEST(memory_reuse_test, memory_kept_mapped_while_another_connection_holds_it_counts_for_its_keeper) {
  if (this->in_process_only()) return;
  auto& l = this->start({.capacity_bytes = 64 * mib, .quota_bytes = 16 * mib});
  borrower a(this->device(), l.address()), c(this->device(), l.address());
  a.give_back(a.borrow(16 * mib, "first"));
  auto theirs = c.borrow(16 * mib, "the same memory");
  ASSERT_EQ(theirs.memory_id(), l.status().regions.at(0).memory);
  auto mine = a.borrow(8 * mib, "another size");
  EXPECT_EQ(a.kept().count, 0u) << "a maps 24 MiB under a quota of 16";
  EXPECT_EQ(l.status().forgets, 1u);
  c.give_back(std::move(theirs));
  const auto s = l.status();
  ASSERT_EQ(s.spares.size(), 1u);
  EXPECT_EQ(s.spares[0].kept_by, 1u) << "c keeps it; a keeps it no more";
}

// A connection that hangs up keeps nothing mapped: what it kept no longer
// counts for its uid, whose whole quota is there again with no forget.
TYPED_TEST(memory_reuse_test, memory_a_connection_kept_mapped_stops_counting_for_its_uid_when_it_hangs_up) {
  if (this->in_process_only()) return;
  auto& l = this->start({.capacity_bytes = 64 * mib, .quota_bytes_per_uid = 16 * mib});
  borrower c(this->device(), l.address());
  {
    borrower a(this->device(), l.address());
    a.give_back(a.borrow(12 * mib, "kept, then hung up"));
    ASSERT_EQ(l.status().spares.at(0).kept_by, 1u);
  }
  ASSERT_TRUE(eventually([&] { return l.status().spares.at(0).kept_by == 0; }));
  auto whole = c.borrow(16 * mib, "the uid's whole quota");
  EXPECT_EQ(l.status().forgets, 0u);
  try {
    (void)c.borrow(4 * mib, "past the uid's quota");
    ADD_FAILURE() << "lent past the uid's quota";
  } catch (const peer_refused& e) {
    EXPECT_NE(std::string(e.what()).find("holds " + std::to_string(16 * mib) + " bytes"), std::string::npos)
        << e.what();
  }
}

TYPED_TEST(memory_reuse_test, a_killed_borrowers_kept_mappings_are_forgotten_and_the_spare_stays) {
  auto& l = this->start();
  auto child = cycle_process(TypeParam::name, this->socket_path(), 2 * mib, 1, "self");
  const auto c = parse_cycled(line_from(*child));
  ASSERT_EQ(c.kept, 1);
  ASSERT_EQ(l.status().spares.size(), 1u);
  ASSERT_EQ(l.status().spares[0].kept_by, 1u);
  ASSERT_EQ(::kill(child->pid(), SIGKILL), 0);
  (void)child->wait();
  EXPECT_TRUE(eventually([&] { return l.status().spares.at(0).kept_by == 0; }, 2000ms))
      << "the dead borrower is still named as keeping the memory mapped";
  // The spare is lent again, with its chunk: no one keeps it mapped now.
  auto next = cycle_process(TypeParam::name, this->socket_path(), 2 * mib, 1, "self");
  const auto n = parse_cycled(line_from(*next));
  ASSERT_EQ(n.memory.size(), 1u);
  EXPECT_EQ(n.memory[0], c.memory[0]);
  EXPECT_EQ(n.imports, 1);
}

TYPED_TEST(memory_reuse_test, a_borrower_of_another_uid_never_gets_memory_another_uid_had) {
  if (!may_act_as({65534}))
    GTEST_SKIP() << "making a borrower of another uid (setresuid to 65534) needs root and the uid mapped";
  const std::string name = "shoal-reuse-test-" + std::to_string(::getpid());
  constexpr uid_t nobody = 65534;
  lender l(this->device(), channel::channel_address::abstract(name),
           {.policy = channel::access_policy{{nobody}, {}}});
  const auto run = [&](const char* as, int rounds) {
    auto child = cycle_process(TypeParam::name, "@" + name, 2 * mib, rounds, as);
    const std::string line = line_from(*child);
    const auto c = parse_cycled(line);
    EXPECT_EQ(c.memory.size(), static_cast<std::size_t>(rounds)) << as << ": " << line;
    return c;
  };
  const auto root_first = run("self", 1);
  const auto other = run("nobody", 2);
  ASSERT_EQ(root_first.memory.size(), 1u);
  ASSERT_EQ(other.memory.size(), 2u);
  EXPECT_NE(other.memory[0], root_first.memory[0]) << "uid 65534 was lent memory uid 0 had mapped";
  EXPECT_EQ(other.memory[1], other.memory[0]) << "its own memory is lent to it again";
  const auto root_again = run("self", 1);
  ASSERT_EQ(root_again.memory.size(), 1u);
  EXPECT_EQ(root_again.memory[0], root_first.memory[0]) << "uid 0 gets its own spare back";
  const auto s = l.status();
  EXPECT_EQ(s.chunks_made, 2u);
  ASSERT_EQ(s.spares.size(), 2u);
  for (const auto& spare : s.spares) {
    EXPECT_EQ(spare.uid, spare.memory == root_first.memory[0] ? 0u : nobody) << "memory " << spare.memory;
  }
}

TYPED_TEST(memory_reuse_test, a_published_regions_memory_is_forgotten_by_its_keepers_and_never_lent_again) {
  if (this->in_process_only()) return;
  auto& l = this->start();
  borrower keeper(this->device(), l.address()), writer(this->device(), l.address());
  auto r = keeper.borrow(mib, "model W");
  const auto memory = r.memory_id();
  keeper.give_back(std::move(r));
  ASSERT_EQ(keeper.kept().count, 1u);
  auto w = writer.borrow(mib, "model W");
  ASSERT_EQ(w.memory_id(), memory) << "the same uid gets the spare";
  lending::region_layout layout;
  layout.entries = {{"weights", 0, mib, lending::dtype::uint8, {mib}}};
  layout.hash = lending::hash_entries(this->device(), w.data(), w.size(), layout);
  w = writer.publish(std::move(w), layout);
  EXPECT_TRUE(keeper.revocations(std::chrono::milliseconds(200)).empty());
  EXPECT_EQ(keeper.kept().count, 0u) << "a writable mapping of a shared region was kept";
  EXPECT_EQ(l.status().forgets, 1u);
  writer.give_back(std::move(w));
  const auto s = l.status();
  EXPECT_TRUE(s.spares.empty()) << "a shared region's memory became a spare";
  EXPECT_EQ(writer.kept().count, 0u);
}

// A lender that answers the first borrow with `answer` (then reads until
// the borrower hangs up).
void lie_to_a_borrower(backend::device& device, const std::string& path,
                       const std::vector<std::pair<lending::detail::message_type, std::vector<std::byte>>>& answer,
                       const std::function<void(borrower&)>& check) {
  const auto address = channel::channel_address::at_path(path);
  channel::listener liar(address, {});
  std::thread server([&] {
    auto link = liar.accept();
    channel::send_hello(link, lending::detail::lending_protocol);
    try {
      (void)link.receive();  // the hello
      (void)link.receive();  // the borrow request
      for (const auto& [type, payload] : answer) link.send(static_cast<std::uint16_t>(type), payload);
      for (;;) (void)link.receive();
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): the borrower hung up
    }
  });
  {
    borrower b(device, address);
    check(b);
  }
  server.join();
}

TYPED_TEST(memory_reuse_test, a_lent_with_no_chunks_for_memory_not_kept_is_a_protocol_error) {
  if (this->in_process_only()) return;
  using lending::detail::message_type;
  lie_to_a_borrower(this->device(), this->dir_ / "liar.sock", {{message_type::lent, lending::detail::encode(lending::detail::lent_message{1, 1, 42, 4096, 0})}},
                    [](borrower& b) {
                      EXPECT_THROW((void)b.borrow(4096, "lied to"), protocol_error);
                      EXPECT_THROW((void)b.borrow(4096, "after the lie"), connection_closed);
                    });
}

TYPED_TEST(memory_reuse_test, a_forget_for_memory_not_kept_is_a_protocol_error) {
  if (this->in_process_only()) return;
  using lending::detail::message_type;
  lie_to_a_borrower(this->device(), this->dir_ / "liar.sock", {{message_type::forget, lending::detail::encode_forget(42)}}, [](borrower& b) {
    EXPECT_THROW((void)b.borrow(4096, "answered with a forget"), protocol_error);
    EXPECT_THROW((void)b.revocations(), connection_closed);
  });
}

TYPED_TEST(memory_reuse_test, a_lender_keeping_one_memory_for_two_regions_is_a_protocol_error) {
  if (this->in_process_only()) return;
  using lending::detail::message_type;
  namespace d = lending::detail;
  auto& dev = this->device();
  const auto address = channel::channel_address::at_path(this->dir_ / "liar.sock");
  channel::listener liar(address, {});
  d::lendable_memory memory(dev, this->unit(), 42);
  std::thread server([&] {
    try {
      auto link = liar.accept();
      channel::send_hello(link, d::lending_protocol);
      (void)link.receive();  // the hello
      const auto chunk = memory.handle().serialize();
      for (std::uint64_t region = 1; region <= 2; ++region) {  // one memory lent as two regions
        const auto request = d::decode_borrow(link.receive().payload).request;
        const auto lent = d::encode(d::lent_message{request, region, 42, this->unit(), 1});
        const std::vector<channel::outgoing_frame> frames{
            {static_cast<std::uint16_t>(message_type::lent), lent},
            {static_cast<std::uint16_t>(message_type::chunk), chunk, memory.handle().fd.get()}};
        link.send(frames);
      }
      for (int i = 0; i < 2; ++i) {  // and both kept
        const auto back = d::decode_give_back(link.receive().payload);
        link.send(static_cast<std::uint16_t>(message_type::given_back),
                  d::encode(d::given_back_message{back.region, true}));
      }
      for (;;) (void)link.receive();
    } catch (const error&) {  // NOLINT(bugprone-empty-catch): the borrower hung up
    }
  });
  {
    borrower b(dev, address);
    auto first = b.borrow(this->unit(), "one");
    auto second = b.borrow(this->unit(), "two");
    b.give_back(std::move(first));
    EXPECT_EQ(b.kept().count, 1u);
    EXPECT_THROW(b.give_back(std::move(second)), protocol_error);
    EXPECT_EQ(b.kept().count, 1u);
    EXPECT_EQ(b.kept().bytes, this->unit()) << "the second mapping was unmapped, not counted beside the first";
    EXPECT_THROW((void)b.borrow(this->unit(), "after the lie"), connection_closed);
  }
  server.join();
}

TYPED_TEST(memory_reuse_test, malformed_give_back_and_forget_frames_close_only_their_sender) {
  if (this->in_process_only()) return;
  auto& l = this->start();
  borrower good(this->device(), l.address());
  auto kept = good.borrow(mib, "kept");
  using lending::detail::message_type;
  auto bad_flag = lending::detail::encode(lending::detail::give_back_message{kept.id(), true});
  bad_flag.back() = std::byte{2};
  const std::vector<std::pair<message_type, std::vector<std::byte>>> attacks{
      {message_type::give_back, bad_flag},
      {message_type::give_back, lending::detail::encode_forget(kept.id())},  // short: no flag
      {message_type::forget, lending::detail::encode_forget(kept.memory_id())},  // a lender's message
      {message_type::given_back, lending::detail::encode(lending::detail::given_back_message{kept.id(), true})},
  };
  for (const auto& [type, payload] : attacks) {
    auto raw = channel::connection::connect(l.address(), {}, lending::detail::max_frame_payload);
    channel::send_hello(raw, lending::detail::lending_protocol);
    (void)raw.receive_for(2000ms);
    raw.send(static_cast<std::uint16_t>(type), payload);
    EXPECT_THROW((void)raw.receive_for(2000ms), connection_closed) << "frame type " << static_cast<int>(type);
  }
  // Asking to keep a mapping of a region it does not hold: refused, nothing recorded.
  auto raw = channel::connection::connect(l.address(), {}, lending::detail::max_frame_payload);
  channel::send_hello(raw, lending::detail::lending_protocol);
  (void)raw.receive_for(2000ms);
  raw.send(static_cast<std::uint16_t>(message_type::give_back),
           lending::detail::encode(lending::detail::give_back_message{kept.id(), true}));
  EXPECT_EQ(raw.receive_for(2000ms).type, static_cast<std::uint16_t>(message_type::refused));
  EXPECT_EQ(l.status().regions.size(), 1u) << "the good borrower's region stays";
  good.give_back(std::move(kept));
  EXPECT_EQ(good.kept().count, 1u);
}

TEST(lending_messages, give_back_given_back_and_forget_round_trip_and_refuse_bad_fields) {
  using namespace lending::detail;
  const auto g = decode_give_back(encode(give_back_message{7, true}));
  EXPECT_EQ(g.region, 7u);
  EXPECT_TRUE(g.keep_mapping);
  const auto a = decode_given_back(encode(given_back_message{8, false}));
  EXPECT_EQ(a.region, 8u);
  EXPECT_FALSE(a.kept);
  EXPECT_EQ(decode_forget(encode_forget(9)), 9u);
  EXPECT_THROW((void)decode_forget(encode_forget(0)), protocol_error) << "memory ids start at 1";
  const auto lent = decode_lent(encode(lent_message{1, 2, 3, 4096, 0}));
  EXPECT_EQ(lent.memory, 3u);
  EXPECT_EQ(lent.chunks, 0u) << "no chunks: a kept mapping";
  EXPECT_THROW((void)decode_lent(encode(lent_message{1, 2, 0, 4096, 1})), protocol_error) << "memory 0";
  EXPECT_THROW((void)decode_lent(encode(lent_message{1, 2, 3, 4096, max_chunks_per_region + 1})), protocol_error);
}

TEST(spare_pool, a_spare_goes_only_to_its_uid_and_size_and_prefers_the_one_the_borrower_keeps_mapped) {
  auto& dev = backend::host_device_instance();
  const std::size_t unit = dev.granularity();
  lending::detail::spare_pool pool;
  const auto now = std::chrono::steady_clock::now();
  const auto chunk = [&](std::uint64_t id, std::vector<std::uint64_t> keepers) {
    return lending::detail::chunk_record{std::make_unique<lending::detail::lendable_memory>(dev, unit, id),
                                         std::move(keepers)};
  };
  pool.put(chunk(1, {}), 1000, now);
  pool.put(chunk(2, {5}), 1000, now);
  pool.put(chunk(3, {}), 2000, now);
  EXPECT_EQ(pool.bytes(), 3 * unit);
  EXPECT_FALSE(pool.take(unit, 3000, 5)) << "a uid that had none of them";
  EXPECT_FALSE(pool.take(2 * unit, 1000, 5)) << "another size";
  EXPECT_EQ(pool.take(unit, 1000, 5)->chunk.memory->id(), 2u) << "the one connection 5 keeps mapped first";
  EXPECT_EQ(pool.take(unit, 1000, 5)->chunk.memory->id(), 1u);
  EXPECT_FALSE(pool.take(unit, 1000, 5));
  pool.put(chunk(4, {6, 7}), 2000, now);
  pool.drop_keeper(6);
  EXPECT_EQ(pool.chunks().back().chunk.keepers, std::vector<std::uint64_t>{7});
  EXPECT_EQ(pool.take_oldest()->chunk.memory->id(), 3u) << "oldest first";
  EXPECT_EQ(pool.bytes(), unit);
}

}  // namespace
}  // namespace shoal::testing
