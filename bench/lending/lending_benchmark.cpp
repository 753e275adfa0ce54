// The memory daemon, timed: a lender in this process, borrowers in child
// processes (this program started again), the anchors in the same run.
//
//   shoal_bench_lending [--backend host|cuda] [--rounds N] [--region-mib N]
//                       [--handover-mib N] [--borrowers N] [--seconds S]
//                       [--reply-spin-us N] [--poll-spin-us N]
//
// 1. Anchors, region size: the device's own calls a region costs — a
//    physical chunk made, reserved + mapped, exported (here), imported and
//    mapped (in a child: CUDA refuses to import in the exporting process).
// 2. Borrow -> mapped -> first allocation from the region (the region
//    adopted into the borrower's caching allocator, one block allocated from
//    it), then the same again right after giving it back (a re-borrow: the
//    lender lends the same memory again and the borrower uses the mapping it
//    kept). Each round's first borrow asks for a size no earlier round had
//    (one granule more), so it gets fresh memory, as a first borrow does
//    growing on demand. Then a first borrow from prepared memory: the lender
//    made one chunk per round when it started (lender_config::
//    prepared_chunks, sizes no other borrow asks for), so the borrow costs
//    the borrower's import and map and no device call in the lender.
// 3. Hand-over: two borrowers take turns on one region's worth of memory.
//    The holder is asked back (lender::revoke), clears its region in stream
//    order and gives it back; the next one borrows, maps and adopts it and
//    allocates from it. Timed from revoke to the next one's first
//    allocation, with the steps, two control messages through this process
//    included. The first hand-over maps the memory in the next borrower;
//    later ones find it kept mapped there (both borrowers are of one uid).
//    Then the same with the next one's borrow sent first, waiting at the
//    lender (borrow_wait): lent as the holder's give back arrives, with no
//    control message in between.
// 4. Many borrowers at once (threads of one child, each its own connection)
//    borrowing and giving back small regions: requests per second, p50/p99.
// 5. Hand-over by preemption: a lender of exactly one hand-over region's
//    capacity with lender_config::preempt_after = 0. The next one's borrow
//    waits; the lender revokes the holder's region itself; the holder,
//    watching revocations(), clears and gives it back; the waiting borrow is
//    lent. Timed from the next one's borrow call to its first allocation:
//    the whole switch with no one but the two models and the lender.
//
// --reply-spin-us sets every borrower's reply_spin (borrower_options; the
// children read it from SHOAL_BENCH_REPLY_SPIN_US), to compare with none.
//
// Every time is a steady_clock reading (CLOCK_MONOTONIC: the same clock in
// every process of the machine). Prints one table: medians with (min-max).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"
#include "shoal/channel/channel.h"
#include "shoal/core/child_process.h"
#include "shoal/core/error.h"
#include "shoal/lending/adopted_region.h"
#include "shoal/lending/borrower.h"
#include "shoal/lending/lender.h"

namespace {

using namespace shoal;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;
constexpr std::size_t mib = std::size_t{1} << 20;
constexpr std::uint16_t text_frame = 1;
constexpr std::uint16_t handle_frame = 2;

struct options {
  std::string backend = "cuda";
  int rounds = 5;
  std::size_t region_bytes = 1024 * mib;
  std::size_t handover_bytes = 12 * 1024 * mib;
  int borrowers = 64;
  double seconds = 2.0;
  int reply_spin_us = -1;  // -1: the borrower's default
  int poll_spin_us = -1;   // -1: the lender's default
};

constexpr const char* reply_spin_variable = "SHOAL_BENCH_REPLY_SPIN_US";

// The borrowers' options: the default, or the reply spin the parent was given.
lending::borrower_options borrower_options_from_parent() {
  lending::borrower_options options;
  if (const char* spin = std::getenv(reply_spin_variable)) {
    options.reply_spin = std::chrono::microseconds(std::stoi(spin));
  }
  return options;
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now().time_since_epoch()).count();
}
double us_between(std::int64_t from, std::int64_t to) { return static_cast<double>(to - from) / 1e3; }

std::string spread_text(std::vector<double> v) {
  if (v.empty()) return "-";
  std::sort(v.begin(), v.end());
  char text[96];
  std::snprintf(text, sizeof text, "%.1f (%.1f-%.1f)", v[v.size() / 2], v.front(), v.back());
  return text;
}

double percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

void send_text(channel::connection& link, const std::string& text, int fd = -1) {
  link.send(fd < 0 ? text_frame : handle_frame, std::as_bytes(std::span(text)), fd);
}

std::string receive_text(channel::connection& link, std::chrono::milliseconds timeout = 120s) {
  channel::frame f = link.receive_for(timeout);
  return {reinterpret_cast<const char*>(f.payload.data()), f.payload.size()};
}

// Numbers of a "word n1 n2 ..." reply.
std::vector<double> numbers_of(const std::string& reply, const std::string& word) {
  std::istringstream in(reply);
  std::string first;
  in >> first;
  if (first != word) throw std::runtime_error("expected '" + word + "', the child said: " + reply);
  std::vector<double> values;
  for (double v; in >> v;) values.push_back(v);
  return values;
}

backend::device& device_named(const std::string& name) {
  return name == "host" ? backend::host_device_instance() : backend::cuda_device_instance(0);
}

// ---- the child's side ------------------------------------------------------

// Borrows `bytes`, adopts it (parameters + computation) and allocates one
// block from it; returns the three step ends as times.
struct adopted_turn {
  std::unique_ptr<lending::adopted_region> region;
  std::int64_t borrowed = 0, adopted = 0, allocated = 0;
};

adopted_turn take_region(lending::borrower& b, alloc::caching_allocator& allocator, backend::stream& s,
                         std::size_t bytes, std::chrono::milliseconds wait = std::chrono::milliseconds(0)) {
  adopted_turn turn;
  lending::borrowed_region r =
      b.borrow(bytes, "model", lending::region_mode::exclusive, lending::borrower::default_timeout, {wait, {}});
  turn.borrowed = now_ns();
  const std::size_t parameters = std::max<std::size_t>(bytes / 8 / mib, 1) * mib;
  turn.region = std::make_unique<lending::adopted_region>(
      allocator, std::move(r),
      std::vector<std::pair<std::string, std::size_t>>{{"parameters", parameters},
                                                       {"computation", bytes - parameters}});
  turn.adopted = now_ns();
  {
    alloc::private_pool_scope scope(allocator, turn.region->pool(), "computation");
    void* block = allocator.allocate(mib, s);
    turn.allocated = now_ns();
    s.owner().fill(s, block, 1, mib);  // the model's work on the region
    allocator.deallocate(block, s);
  }
  return turn;
}

void give_region_back(lending::borrower& b, adopted_turn& turn) {
  b.give_back(turn.region->release());
  turn.region.reset();
}

int run_child(const std::string& role, const std::string& backend_name, const std::string& path,
              const std::vector<std::string>& args) {
  auto& dev = device_named(backend_name);
  auto control = channel::connection::adopt_pair_end(unique_fd(child_process::child_socket_fd), {});
  try {
    if (role == "import-anchor") {
      // Imports each handle the parent sends, maps it, and closes it.
      for (;;) {
        channel::frame f = control.receive_for(120s);
        if (f.type != handle_frame) break;
        const auto handle = backend::shareable_handle::deserialize(f.payload, std::move(f.fd));
        const auto t0 = now_ns();
        void* p = dev.import_memory(std::span(&handle, 1));
        const auto t1 = now_ns();
        dev.close_import(p);
        const auto t2 = now_ns();
        send_text(control, "imported " + std::to_string(us_between(t0, t1)) + " " + std::to_string(us_between(t1, t2)));
      }
      return 0;
    }
    lending::borrower b(dev, channel::channel_address::at_path(path), {}, lending::borrower::default_timeout,
                        borrower_options_from_parent());
    alloc::caching_allocator allocator(dev);
    backend::stream s(dev);
    if (role == "first") {
      const std::size_t base = std::stoull(args.at(0));
      const int rounds = std::stoi(args.at(1));
      const std::size_t prepared_base = std::stoull(args.at(2));
      {
        auto warm = take_region(b, allocator, s, 2 * mib);  // the first borrow of the process, untimed
        give_region_back(b, warm);
      }
      for (int i = 0; i < rounds; ++i) {
        const std::size_t step = static_cast<std::size_t>(i) * dev.granularity();
        for (const char* kind : {"first", "again", "prepared"}) {
          // first and again: a size new to the lender; prepared: one it made at start.
          const std::size_t bytes = (std::string(kind) == "prepared" ? prepared_base : base) + step;
          const auto t0 = now_ns();
          auto turn = take_region(b, allocator, s, bytes);
          s.synchronize();
          const auto t1 = now_ns();
          give_region_back(b, turn);
          const auto t2 = now_ns();
          send_text(control, std::string(kind) + " " + std::to_string(us_between(t0, turn.borrowed)) + " " +
                                 std::to_string(us_between(turn.borrowed, turn.adopted)) + " " +
                                 std::to_string(us_between(turn.adopted, turn.allocated)) + " " +
                                 std::to_string(us_between(t0, turn.allocated)) + " " +
                                 std::to_string(us_between(t1, t2)));
        }
      }
      return 0;
    }
    if (role == "turns") {
      // Takes the region when told, gives it back when the lender asks.
      const std::size_t bytes = std::stoull(args.at(0));
      adopted_turn turn;
      for (;;) {
        const std::string command = receive_text(control);
        if (command == "take" || command == "take-waiting") {
          // take-waiting: asked before the memory is free, the borrow waits
          // at the lender until the holder gives it back.
          const auto t0 = now_ns();
          turn = take_region(b, allocator, s, bytes, command == "take" ? 0s : 10s);
          send_text(control, "took " + std::to_string(turn.region->region().id()) + " " + std::to_string(t0) + " " +
                                 std::to_string(turn.borrowed) + " " + std::to_string(turn.adopted) + " " +
                                 std::to_string(turn.allocated));
        } else if (command == "yield") {
          std::vector<lending::borrower::revocation> asked;
          while (asked.empty()) asked = b.revocations(10s);
          const auto seen = now_ns();
          auto region = turn.region->release();  // waits for the streams that used it
          const auto cleared = now_ns();
          b.give_back(std::move(region));
          turn.region.reset();
          const auto given = now_ns();
          send_text(control, "yielded " + std::to_string(seen) + " " + std::to_string(cleared) + " " +
                                 std::to_string(given));
        } else {
          return 0;
        }
      }
    }
    if (role == "many") {
      const int threads = std::stoi(args.at(0));
      const double seconds = std::stod(args.at(1));
      const std::size_t bytes = std::stoull(args.at(2));
      std::vector<std::vector<double>> borrow_us(threads), give_us(threads);
      std::atomic<int> ready{0};
      std::atomic<bool> go{false};
      std::atomic<int> failures{0};
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          try {
            lending::borrower mine(dev, channel::channel_address::at_path(path), {},
                                   lending::borrower::default_timeout, borrower_options_from_parent());
            ready.fetch_add(1);
            while (!go.load()) std::this_thread::yield();
            const auto until = clock_type::now() + std::chrono::duration<double>(seconds);
            while (clock_type::now() < until) {
              const auto t0 = now_ns();
              auto r = mine.borrow(bytes, "worker");
              const auto t1 = now_ns();
              mine.give_back(std::move(r));
              const auto t2 = now_ns();
              borrow_us[t].push_back(us_between(t0, t1));
              give_us[t].push_back(us_between(t1, t2));
            }
          } catch (const std::exception& e) {
            std::fprintf(stderr, "borrower thread %d: %s\n", t, e.what());
            failures.fetch_add(1);
            ready.fetch_add(1);
          }
        });
      }
      while (ready.load() < threads) std::this_thread::sleep_for(1ms);
      const auto t0 = now_ns();
      go.store(true);
      for (auto& th : pool) th.join();
      const double elapsed = us_between(t0, now_ns()) / 1e6;
      std::vector<double> all_borrow, all_give;
      for (int t = 0; t < threads; ++t) {
        all_borrow.insert(all_borrow.end(), borrow_us[t].begin(), borrow_us[t].end());
        all_give.insert(all_give.end(), give_us[t].begin(), give_us[t].end());
      }
      const double requests = static_cast<double>(all_borrow.size() + all_give.size());
      send_text(control, "many " + std::to_string(requests / elapsed) + " " +
                             std::to_string(percentile(all_borrow, 0.5)) + " " +
                             std::to_string(percentile(all_borrow, 0.99)) + " " +
                             std::to_string(percentile(all_give, 0.5)) + " " +
                             std::to_string(percentile(all_give, 0.99)) + " " + std::to_string(failures.load()));
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal_bench_lending %s: %s\n", role.c_str(), e.what());
    try {
      send_text(control, std::string("failed ") + e.what());
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): the parent reports the missing reply
    }
    return 1;
  }
  std::fprintf(stderr, "shoal_bench_lending: unknown child role %s\n", role.c_str());
  return 2;
}

// ---- the parent's side -----------------------------------------------------

struct child {
  std::unique_ptr<child_process> process;
  std::unique_ptr<channel::connection> control;
};

child start_child(const std::string& self, const std::string& role, const options& o, const std::string& path,
                  std::vector<std::string> args = {}) {
  std::vector<std::string> all{"--child", role, o.backend, path};
  all.insert(all.end(), args.begin(), args.end());
  child c;
  c.process = std::make_unique<child_process>(self, all);
  c.control = std::make_unique<channel::connection>(
      channel::connection::adopt_pair_end(unique_fd(::dup(c.process->socket())), {}));
  return c;
}

struct row {
  std::string what, figure;
};

int run_parent(const std::string& self, const options& o) {
  auto& dev = device_named(o.backend);
  const std::size_t g = dev.granularity();
  const std::size_t region = (o.region_bytes + g - 1) / g * g;
  const std::size_t handover = (o.handover_bytes + g - 1) / g * g;
  const std::size_t prepared_base = region + static_cast<std::size_t>(o.rounds) * g;  // past the fresh sizes
  char dir_template[] = "/tmp/shoal-bench-lending-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) throw std::runtime_error("mkdtemp failed");
  const std::filesystem::path dir(dir_template);
  const std::string path = dir / "lender.sock";
  std::vector<row> rows;
  {
    lending::lender_config config;
    if (o.poll_spin_us >= 0) config.poll_spin = std::chrono::microseconds(o.poll_spin_us);
    // Prepared chunks for section 2: one a round, of sizes no other borrow asks for.
    const auto rounds = static_cast<std::size_t>(o.rounds);
    for (std::size_t i = 0; i < rounds; ++i) config.prepared_chunks.push_back(prepared_base + i * g);
    config.capacity_bytes = std::max(handover, region) + 2 * region + static_cast<std::size_t>(o.borrowers) * 4 * g +
                            rounds * (prepared_base + rounds * g);
    config.quota_bytes = config.capacity_bytes;
    config.max_borrowers = static_cast<std::size_t>(o.borrowers) + 8;
    lending::lender lender(dev, channel::channel_address::at_path(path), config);

    // 1. Anchors.
    {
      std::vector<double> create_us, map_us, export_us, import_us, close_us;
      auto importer = start_child(self, "import-anchor", o, path);
      for (int i = 0; i < o.rounds; ++i) {
        const auto t0 = now_ns();
        auto chunk = dev.create_physical(region);
        const auto t1 = now_ns();
        void* base = dev.reserve_range(region);
        dev.map(base, chunk);
        const auto t2 = now_ns();
        const auto handle = dev.export_memory(base);
        const auto t3 = now_ns();
        const auto bytes = handle.serialize();
        importer.control->send(handle_frame, bytes, backend::carries_fd(handle.kind) ? handle.fd.get() : -1);
        const auto times = numbers_of(receive_text(*importer.control), "imported");
        dev.unmap(base);
        dev.release_range(base);
        dev.release_physical(chunk);
        create_us.push_back(us_between(t0, t1));
        map_us.push_back(us_between(t1, t2));
        export_us.push_back(us_between(t2, t3));
        import_us.push_back(times.at(0));
        close_us.push_back(times.at(1));
      }
      send_text(*importer.control, "done");
      importer.process->wait();
      std::vector<double> sum;
      for (std::size_t i = 0; i < create_us.size(); ++i) sum.push_back(create_us[i] + map_us[i] + export_us[i] + import_us[i]);
      const std::string size = std::to_string(region / mib) + " MiB";
      rows.push_back({"anchor: physical chunk made, " + size, spread_text(create_us)});
      rows.push_back({"anchor: reserved + mapped", spread_text(map_us)});
      rows.push_back({"anchor: exported", spread_text(export_us)});
      rows.push_back({"anchor: imported + mapped (another process)", spread_text(import_us)});
      rows.push_back({"anchor: the four together", spread_text(sum)});
    }

    // 2. Borrow -> first allocation.
    {
      auto c = start_child(self, "first", o, path,
                           {std::to_string(region), std::to_string(o.rounds), std::to_string(prepared_base)});
      std::vector<double> first[5], again[5], prepared[5];
      for (int i = 0; i < 3 * o.rounds; ++i) {
        const std::string reply = receive_text(*c.control);
        const std::string kind = reply.substr(0, reply.find(' '));
        auto& into = kind == "first" ? first : kind == "again" ? again : prepared;
        const auto v = numbers_of(reply, kind == "first" || kind == "again" ? kind : "prepared");
        for (int k = 0; k < 5; ++k) into[k].push_back(v.at(k));
      }
      c.process->wait();
      const std::string size = std::to_string(region / mib) + " MiB";
      rows.push_back({"borrow -> first allocation, " + size + " (first time)", spread_text(first[3])});
      rows.push_back({"  of which borrow + map", spread_text(first[0])});
      rows.push_back({"  of which adopt into the allocator", spread_text(first[1])});
      rows.push_back({"  of which first allocation", spread_text(first[2])});
      rows.push_back({"borrow -> first allocation, " + size + " (first time, prepared memory)",
                      spread_text(prepared[3])});
      rows.push_back({"  of which borrow + map", spread_text(prepared[0])});
      rows.push_back({"  of which adopt into the allocator", spread_text(prepared[1])});
      rows.push_back({"re-borrow -> first allocation, " + size, spread_text(again[3])});
      rows.push_back({"  of which borrow", spread_text(again[0])});
      rows.push_back({"  of which adopt into the allocator", spread_text(again[1])});
      rows.push_back({"clear + give back, " + size, spread_text(first[4])});
    }

    // 3. Hand-over between two borrowers.
    {
      const std::string bytes = std::to_string(handover);
      child turns[2] = {start_child(self, "turns", o, path, {bytes}), start_child(self, "turns", o, path, {bytes})};
      send_text(*turns[0].control, "take");
      auto took = numbers_of(receive_text(*turns[0].control), "took");
      std::vector<double> total, to_seen, clear, give, relay, borrow, adopt, allocate, first_total, later_total;
      for (int i = 0; i < o.rounds; ++i) {
        child& holder = turns[i % 2];
        child& next = turns[(i + 1) % 2];
        send_text(*holder.control, "yield");
        const auto t0 = now_ns();
        lender.revoke(static_cast<std::uint64_t>(took.at(0)), 5000ms);
        const auto yielded = numbers_of(receive_text(*holder.control), "yielded");
        send_text(*next.control, "take");
        took = numbers_of(receive_text(*next.control), "took");
        total.push_back(us_between(t0, static_cast<std::int64_t>(took.at(4))));
        (i == 0 ? first_total : later_total).push_back(total.back());
        to_seen.push_back(us_between(t0, static_cast<std::int64_t>(yielded.at(0))));
        clear.push_back(us_between(static_cast<std::int64_t>(yielded.at(0)), static_cast<std::int64_t>(yielded.at(1))));
        give.push_back(us_between(static_cast<std::int64_t>(yielded.at(1)), static_cast<std::int64_t>(yielded.at(2))));
        relay.push_back(us_between(static_cast<std::int64_t>(yielded.at(2)), static_cast<std::int64_t>(took.at(1))));
        borrow.push_back(us_between(static_cast<std::int64_t>(took.at(1)), static_cast<std::int64_t>(took.at(2))));
        adopt.push_back(us_between(static_cast<std::int64_t>(took.at(2)), static_cast<std::int64_t>(took.at(3))));
        allocate.push_back(us_between(static_cast<std::int64_t>(took.at(3)), static_cast<std::int64_t>(took.at(4))));
      }
      for (auto& t : turns) send_text(*t.control, "end");
      for (auto& t : turns) t.process->wait();
      const std::string size = std::to_string(handover / mib) + " MiB";
      rows.push_back({"hand-over " + size + ": revoke -> next one's first allocation", spread_text(total)});
      rows.push_back({"  the first (the next one maps the memory)", spread_text(first_total)});
      rows.push_back({"  later ones (the next one kept its mapping)", spread_text(later_total)});
      rows.push_back({"  revoke seen by the holder", spread_text(to_seen)});
      rows.push_back({"  stream-ordered clear (release)", spread_text(clear)});
      rows.push_back({"  give back (confirmed)", spread_text(give)});
      rows.push_back({"  two control messages (holder -> bench -> next)", spread_text(relay)});
      rows.push_back({"  borrow + map", spread_text(borrow)});
      rows.push_back({"  adopt", spread_text(adopt)});
      rows.push_back({"  first allocation", spread_text(allocate)});
    }

    // 3b. The same hand-over with the next one's borrow waiting at the lender
    // (borrow_wait) before the revoke: no control message between the
    // holder's give back and the next one's borrow.
    {
      const std::string bytes = std::to_string(handover);
      child turns[2] = {start_child(self, "turns", o, path, {bytes}), start_child(self, "turns", o, path, {bytes})};
      send_text(*turns[0].control, "take");
      auto took = numbers_of(receive_text(*turns[0].control), "took");
      // The rest of the capacity held by a third borrower (spares released
      // for it), so the next one's borrow cannot be lent before the give back.
      const auto before = lender.status();
      const std::size_t rest = (before.capacity_bytes - before.lent_bytes) / g * g;
      child filler = start_child(self, "turns", o, path, {std::to_string(rest)});
      if (rest > 0) {
        send_text(*filler.control, "take");
        (void)numbers_of(receive_text(*filler.control), "took");
      }
      std::vector<double> total, give_to_lent, later_total;
      for (int i = 0; i < o.rounds; ++i) {
        child& holder = turns[i % 2];
        child& next = turns[(i + 1) % 2];
        send_text(*next.control, "take-waiting");
        const auto give_up = std::chrono::steady_clock::now() + 10s;
        while (lender.status().waiting.empty()) {
          if (std::chrono::steady_clock::now() > give_up) throw std::runtime_error("the next one's borrow did not wait");
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
        send_text(*holder.control, "yield");
        const auto t0 = now_ns();
        lender.revoke(static_cast<std::uint64_t>(took.at(0)), 5000ms);
        const auto yielded = numbers_of(receive_text(*holder.control), "yielded");
        took = numbers_of(receive_text(*next.control), "took");
        total.push_back(us_between(t0, static_cast<std::int64_t>(took.at(4))));
        if (i > 0) later_total.push_back(total.back());
        // From the holder's give back (sent once its clear is done) to the
        // waiting borrow's return: the lender lends as the give back comes in.
        give_to_lent.push_back(
            us_between(static_cast<std::int64_t>(yielded.at(1)), static_cast<std::int64_t>(took.at(2))));
      }
      for (auto* t : {&turns[0], &turns[1], &filler}) send_text(*t->control, "end");
      for (auto* t : {&turns[0], &turns[1], &filler}) t->process->wait();
      const std::string size = std::to_string(handover / mib) + " MiB";
      rows.push_back({"hand-over " + size + ", next one waiting: revoke -> its first allocation",
                      spread_text(total)});
      rows.push_back({"  later ones (the next one kept its mapping)", spread_text(later_total)});
      rows.push_back({"  give back sent -> the waiting borrow lent + mapped", spread_text(give_to_lent)});
    }

    // 4. Many borrowers at once.
    {
      auto c = start_child(self, "many", o, path,
                           {std::to_string(o.borrowers), std::to_string(o.seconds), std::to_string(g)});
      const auto v = numbers_of(receive_text(*c.control, 600s), "many");
      c.process->wait();
      char rps[64];
      std::snprintf(rps, sizeof rps, "%.0f", v.at(0));
      const std::string n = std::to_string(o.borrowers);
      rows.push_back({n + " borrowers: requests/s (borrow + give back of " + std::to_string(g / 1024) + " KiB)", rps});
      char latency[2][64];
      std::snprintf(latency[0], sizeof latency[0], "%.1f / %.1f", v.at(1), v.at(2));
      std::snprintf(latency[1], sizeof latency[1], "%.1f / %.1f", v.at(3), v.at(4));
      rows.push_back({n + " borrowers: borrow p50 / p99", latency[0]});
      rows.push_back({n + " borrowers: give back p50 / p99", latency[1]});
      if (v.at(5) != 0) rows.push_back({"borrower threads that failed", std::to_string(static_cast<int>(v.at(5)))});
    }
  }

  // 5. Hand-over by preemption (a lender of its own, after the first is gone).
  {
    lending::lender_config config;
    if (o.poll_spin_us >= 0) config.poll_spin = std::chrono::microseconds(o.poll_spin_us);
    config.capacity_bytes = handover;
    config.quota_bytes = handover;
    config.preempt_after = std::chrono::milliseconds(0);
    config.preempt_deadline = std::chrono::milliseconds(5000);
    const std::string preempting_path = dir / "preempting.sock";
    lending::lender lender(dev, channel::channel_address::at_path(preempting_path), config);
    const std::string bytes = std::to_string(handover);
    child turns[2] = {start_child(self, "turns", o, preempting_path, {bytes}),
                      start_child(self, "turns", o, preempting_path, {bytes})};
    send_text(*turns[0].control, "take");
    (void)numbers_of(receive_text(*turns[0].control), "took");
    std::vector<double> total, later_total, to_seen, clear, give_to_lent;
    for (int i = 0; i < o.rounds; ++i) {
      child& holder = turns[i % 2];
      child& next = turns[(i + 1) % 2];
      send_text(*holder.control, "yield");  // it watches for the lender's revoke
      send_text(*next.control, "take-waiting");
      const auto yielded = numbers_of(receive_text(*holder.control), "yielded");
      const auto took = numbers_of(receive_text(*next.control), "took");
      const auto asked = static_cast<std::int64_t>(took.at(1));
      total.push_back(us_between(asked, static_cast<std::int64_t>(took.at(4))));
      if (i > 0) later_total.push_back(total.back());
      to_seen.push_back(us_between(asked, static_cast<std::int64_t>(yielded.at(0))));
      clear.push_back(us_between(static_cast<std::int64_t>(yielded.at(0)), static_cast<std::int64_t>(yielded.at(1))));
      give_to_lent.push_back(
          us_between(static_cast<std::int64_t>(yielded.at(1)), static_cast<std::int64_t>(took.at(2))));
    }
    for (auto& t : turns) send_text(*t.control, "end");
    for (auto& t : turns) t.process->wait();
    const auto s = lender.status();
    const std::string size = std::to_string(handover / mib) + " MiB";
    rows.push_back({"hand-over " + size + " by preemption: borrow -> its first allocation", spread_text(total)});
    rows.push_back({"  later ones (the next one kept its mapping)", spread_text(later_total)});
    rows.push_back({"  borrow -> the lender's revoke seen by the holder", spread_text(to_seen)});
    rows.push_back({"  stream-ordered clear (release)", spread_text(clear)});
    rows.push_back({"  give back sent -> the waiting borrow lent + mapped", spread_text(give_to_lent)});
    rows.push_back({"  preemptions (one a turn)", std::to_string(s.preemptions)});
  }
  std::filesystem::remove_all(dir);

  const auto spin = [](int us) { return us < 0 ? std::string("the default") : std::to_string(us) + " us"; };
  std::printf("\nshoal_bench_lending on %s (%s), %d rounds, reply spin %s, lender poll spin %s; microseconds: median "
              "(min-max)\n",
              dev.name().c_str(), o.backend.c_str(), o.rounds, spin(o.reply_spin_us).c_str(),
              spin(o.poll_spin_us).c_str());
  for (const auto& r : rows) std::printf("| %-66s | %24s |\n", r.what.c_str(), r.figure.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc >= 5 && std::string(argv[1]) == "--child") {
      return run_child(argv[2], argv[3], argv[4], std::vector<std::string>(argv + 5, argv + argc));
    }
    options o;
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string key = argv[i], value = argv[i + 1];
      if (key == "--backend") {
        o.backend = value;
      } else if (key == "--rounds") {
        o.rounds = std::max(1, std::stoi(value));
      } else if (key == "--region-mib") {
        o.region_bytes = std::stoull(value) * mib;
      } else if (key == "--handover-mib") {
        o.handover_bytes = std::stoull(value) * mib;
      } else if (key == "--borrowers") {
        o.borrowers = std::max(1, std::stoi(value));
      } else if (key == "--seconds") {
        o.seconds = std::stod(value);
      } else if (key == "--poll-spin-us") {
        o.poll_spin_us = std::max(0, std::stoi(value));
      } else if (key == "--reply-spin-us") {
        o.reply_spin_us = std::max(0, std::stoi(value));
        ::setenv(reply_spin_variable, std::to_string(o.reply_spin_us).c_str(), 1);
      } else {
        std::fprintf(stderr,
                     "usage: %s [--backend host|cuda] [--rounds N] [--region-mib N] [--handover-mib N] "
                     "[--borrowers N] [--seconds S] [--reply-spin-us N] [--poll-spin-us N]\n",
                     argv[0]);
        return 2;
      }
    }
    return run_parent(std::filesystem::read_symlink("/proc/self/exe").string(), o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal_bench_lending: %s\n", e.what());
    return 1;
  }
}
