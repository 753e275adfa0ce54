// Sharing storages between two processes, timed: the round trip (send,
// receive, touch, drop, acknowledgement) with the segment already open in
// the consumer; the first share of a new segment; and a long run of
// storages shared and released, watching memory stay flat.
//
//   shoal_bench_ipc [--backend host|cuda] [--iterations N] [--million N]
//                   [--ring-bytes N] [--breakdown 1] [--import-answer-spin-us N]
//                   [--consumer-receive-spin-us N] [--consumer-collect-ms N]
// Prints one table (and with --breakdown 1 one more: what a 64 MiB round
// trip adds to a 4 KiB one); the consumer is this program started again. Both sides
// send through shared rings of --ring-bytes (sharing_options::ring_bytes,
// its default when not given); 0 runs the socket alone. The producer's
// receive after a send that brought the consumer a new segment polls for
// --import-answer-spin-us (sharing_options::import_answer_spin, its default
// when not given; 0: receive_spin alone). The consumer's own receive_spin
// and collect_interval can be set apart from the producer's, to see what its
// wake-up from a sleep and its collector's closes add to a first share.
#include <cstring>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "shoal/alloc/caching_allocator.h"
#include "shoal/backend/devices.h"
#include "shoal/backend/stream.h"
#include "shoal/core/error.h"
#include "shoal/core/child_process.h"
#include "shoal/ipc/sharing.h"

namespace {

using namespace shoal;
using clock_type = std::chrono::steady_clock;

struct options {
  std::string backend = "cuda";
  int iterations = 2000;
  long million = 1000000;
  std::size_t ring_bytes = ipc::sharing_options{}.ring_bytes;
  bool breakdown = false;
  long import_answer_spin_us = ipc::sharing_options{}.import_answer_spin.count();
  long consumer_receive_spin_us = ipc::sharing_options{}.receive_spin.count();
  long consumer_collect_ms = ipc::sharing_options{}.collect_interval.count();
};

ipc::sharing_options sharing_with_ring(std::size_t ring_bytes, long import_answer_spin_us = 0) {
  ipc::sharing_options o;
  o.ring_bytes = ring_bytes;
  o.import_answer_spin = std::chrono::microseconds(import_answer_spin_us);
  o.max_peer_ring_bytes = std::max(o.max_peer_ring_bytes, std::bit_ceil(ring_bytes));  // both sides run with --ring-bytes
  return o;
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now().time_since_epoch()).count();
}

std::size_t resident_kib() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)) / 1024;
}

backend::device& device_named(const std::string& name) {
  return name == "host" ? backend::host_device_instance() : backend::cuda_device_instance(0);
}

channel::connection adopt(int fd) { return channel::connection::adopt_pair_end(unique_fd(fd), {}, 1 << 20); }

double micros_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
}

// Where a consumer's time goes, per storage: from the producer's send call
// to receive's return (the clock is the machine's: steady_clock reads
// CLOCK_MONOTONIC in both processes), touch, drop.
struct consumer_steps {
  std::vector<double> receive, touch, drop;
  std::string medians() const {
    auto med = [](std::vector<double> v) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    char text[160];
    std::snprintf(text, sizeof text, "%.1f %.1f %.1f", med(receive), med(touch), med(drop));
    return text;
  }
};

// The consumer: receive, touch one byte (a copy to the host and a wait),
// drop, acknowledge. A note "?" answers with its resident KiB; a note "s"
// with the median microseconds of its steps since the last "s"; a note "p"
// with an empty note at once (the message floor).
int consume(const std::string& backend_name, std::size_t ring_bytes, long receive_spin_us, long collect_ms) {
  backend::device& dev = device_named(backend_name);
  alloc::caching_allocator allocator(dev, {});
  ipc::sharing_options sharing = sharing_with_ring(ring_bytes);
  sharing.receive_spin = std::chrono::microseconds(receive_spin_us);
  sharing.collect_interval = std::chrono::milliseconds(collect_ms);
  ipc::sharing_context context(allocator, sharing);
  ipc::peer producer(context, adopt(child_process::child_socket_fd));
  backend::stream s(dev);
  backend::stream_guard on_s(dev, s);
  std::uint8_t seen = 0;
  const std::byte ack[1] = {std::byte{1}};
  consumer_steps steps;
  for (;;) {
    // receive() waits as it does for any user: spinning for receive_spin,
    // on the ring (or the socket without one), then blocked.
    ipc::received r = producer.receive(s);
    const std::int64_t received_ns = now_ns();
    if (!r.storage.valid()) {
      if (r.metadata.empty()) return 0;
      std::string answer;
      if (r.metadata[0] == std::byte{'p'}) {
        producer.send_note(ack);
        continue;
      }
      if (r.metadata[0] == std::byte{'s'}) {
        answer = steps.medians();
        steps = {};
      } else {
        answer = std::to_string(resident_kib());
      }
      producer.send_note(std::as_bytes(std::span(answer)));
      continue;
    }
    std::int64_t sent_ns = 0;  // the producer's clock as its send began
    if (r.metadata.size() == sizeof sent_ns) std::memcpy(&sent_ns, r.metadata.data(), sizeof sent_ns);
    steps.receive.push_back(static_cast<double>(received_ns - sent_ns) / 1000.0);
    auto t0 = clock_type::now();
    dev.copy(s, &seen, r.storage.data(), 1);
    dev.synchronize(s);
    steps.touch.push_back(micros_since(t0));
    t0 = clock_type::now();
    r.storage = {};
    steps.drop.push_back(micros_since(t0));
    producer.send_note(ack);
  }
}

struct percentiles {
  double median, p90;
};
percentiles summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v[v.size() * 9 / 10]};
}

class producer_side {
 public:
  producer_side(backend::device& dev, const std::string& program, const options& o)
      : dev_(dev),
        allocator_(dev, {}),
        context_(allocator_, sharing_with_ring(o.ring_bytes, o.import_answer_spin_us)),
        child_(program, {"--consume", o.backend, std::to_string(o.ring_bytes), std::to_string(o.consumer_receive_spin_us),
                         std::to_string(o.consumer_collect_ms)}),
        peer_(context_, adopt(::dup(child_.socket()))),
        stream_(dev),
        on_stream_(dev, stream_) {}
  ~producer_side() {
    peer_.send_note({});
    child_.wait();
  }

  double round_trip_us(const storage::storage& st) {
    const auto t0 = clock_type::now();
    const std::int64_t sent_ns = now_ns();
    std::byte stamp[sizeof sent_ns];
    std::memcpy(stamp, &sent_ns, sizeof sent_ns);
    peer_.send(st, stamp, stream_);
    sends_.push_back(micros_since(t0));
    (void)peer_.receive(stream_);
    return micros_since(t0);
  }
  /// "send a b c d": medians of this side's send and the consumer's steps,
  /// since the last call.
  std::string steps() {
    const std::byte ask[1] = {std::byte{'s'}};
    peer_.send_note(ask);
    const auto answer = peer_.receive(stream_).metadata;
    std::sort(sends_.begin(), sends_.end());
    char text[64];
    std::snprintf(text, sizeof text, "%.1f ", sends_.empty() ? 0.0 : sends_[sends_.size() / 2]);
    sends_.clear();
    return text + std::string(reinterpret_cast<const char*>(answer.data()), answer.size());
  }
  std::vector<double> sends_;
  /// A storage of `bytes` with its first `written` bytes (all when 0)
  /// filled, the fill waited for.
  storage::storage make(std::size_t bytes, std::size_t written = 0) {
    auto st = storage::storage::allocate(allocator_, bytes, stream_);
    dev_.fill(stream_, st.mutable_data(stream_), 7, written == 0 ? bytes : std::min(written, bytes));
    dev_.synchronize(stream_);
    return st;
  }
  std::size_t consumer_rss_kib() {
    const std::byte ask[1] = {std::byte{'?'}};
    peer_.send_note(ask);
    const auto answer = peer_.receive(stream_).metadata;
    return std::stoul(std::string(reinterpret_cast<const char*>(answer.data()), answer.size()));
  }

  backend::device& dev_;
  alloc::caching_allocator allocator_;
  ipc::sharing_context context_;
  child_process child_;
  ipc::peer peer_;
  backend::stream stream_;
  backend::stream_guard on_stream_;
};

// One way of timing round trips with the segment open: each storage of
// `bytes`, `written` of it filled (0: all), the last `kept` alive (the
// anchor keeps 8); before each send, `elsewhere` bytes of another storage
// are filled and waited for (by synchronize, or by polling the stream),
// then the producer spins or sleeps `idle` more.
struct round_trip_case {
  const char* name;
  std::size_t bytes;
  std::size_t written = 0;
  std::size_t kept = 8;
  std::size_t elsewhere = 0;
  std::chrono::microseconds idle{0};
  bool sleep = false;
  bool poll = false;
};

void round_trips(producer_side& p, const options& o, const round_trip_case& c) {
  std::vector<storage::storage> keep;
  std::optional<storage::storage> other;
  if (c.elsewhere > 0) other = p.make(c.elsewhere);
  std::vector<double> times;
  for (int i = 0; i < o.iterations + 20; ++i) {
    auto st = p.make(c.bytes, c.written);
    if (other) {
      p.dev_.fill(p.stream_, other->mutable_data(p.stream_), 1, c.elsewhere);
      if (c.poll) {
        while (!p.dev_.query(p.stream_)) {
        }
      } else {
        p.dev_.synchronize(p.stream_);
      }
    }
    if (c.sleep) {
      std::this_thread::sleep_for(c.idle);
    } else {
      for (const auto until = clock_type::now() + c.idle; clock_type::now() < until;) {
      }
    }
    const double us = p.round_trip_us(st);
    if (i >= 20) times.push_back(us);
    keep.push_back(std::move(st));
    if (keep.size() > c.kept) keep.erase(keep.begin());
  }
  const auto [median, p90] = summarize(times);
  std::printf("| %s | %.1f | %.1f | %s |\n", c.name, median, p90, p.steps().c_str());
}

// What a 64 MiB round trip adds to a 4 KiB one, taken apart: the size of
// the write before it, the number of segments in turn, a large write
// elsewhere (waited for by synchronize or by polling), and a longer pause
// between round trips (spinning or asleep).
void round_trip_breakdown(producer_side& p, const options& o) {
  constexpr std::size_t small = std::size_t{4} << 10, large = std::size_t{64} << 20;
  std::printf("\n| what the 64 MiB round trip adds, same run | median us | p90 us | medians as above |\n|---|---|---|---|\n");
  for (const round_trip_case& c : {
           round_trip_case{"4 KiB (as above)", small},
           round_trip_case{"64 MiB (as above)", large},
           round_trip_case{"64 MiB, 4 KiB of it written", large, small},
           round_trip_case{"64 MiB, one storage at a time (one segment)", large, 0, 0},
           round_trip_case{"4 KiB, 64 MiB written elsewhere before each", small, 0, 8, large},
           round_trip_case{"4 KiB, 64 MiB written elsewhere, waited for by polling", small, 0, 8, large, {}, false, true},
           round_trip_case{"4 KiB, 30 us spent before each send", small, 0, 8, 0, std::chrono::microseconds{30}},
           round_trip_case{"4 KiB, 30 us asleep before each send", small, 0, 8, 0, std::chrono::microseconds{30}, true},
       }) {
    round_trips(p, o, c);
  }
}

// What a round trip costs without its storage, in the same run: a note
// and its answer (the two messages' way through the socket and the
// waiting), the touch alone (here, on a storage of this process), and a
// stream query (send and drop each make one).
void round_trip_floor(producer_side& p, const options& o) {
  std::vector<double> ping, touch, query;
  const std::byte ask[1] = {std::byte{'p'}};
  auto st = p.make(4 << 10);
  std::uint8_t seen = 0;
  for (int i = 0; i < o.iterations + 20; ++i) {
    auto t0 = clock_type::now();
    p.peer_.send_note(ask);
    (void)p.peer_.receive(p.stream_);
    const double ping_us = micros_since(t0);
    t0 = clock_type::now();
    p.dev_.copy(p.stream_, &seen, st.data(), 1);
    p.dev_.synchronize(p.stream_);
    const double touch_us = micros_since(t0);
    t0 = clock_type::now();
    (void)p.dev_.query(p.stream_);
    const double query_us = micros_since(t0);
    if (i < 20) continue;
    ping.push_back(ping_us);
    touch.push_back(touch_us);
    query.push_back(query_us);
  }
  std::printf("\n| a round trip's floor, same run | median us | p90 us |\n|---|---|---|\n");
  const auto row = [](const char* what, std::vector<double> v) {
    const auto [median, p90] = summarize(std::move(v));
    std::printf("| %s | %.1f | %.1f |\n", what, median, p90);
  };
  row("a note and its answer (two messages, no storage)", ping);
  row("touch alone (one byte to the host, then a wait)", touch);
  row("a query of an idle stream", query);
}

void first_shares(producer_side& p, const options& o) {
  // Each storage gets a segment of its own (64 MiB: one per request); the
  // cache is emptied between shares so the next one is a new segment.
  std::vector<double> times;
  const int n = std::max(20, o.iterations / 20);
  for (int i = 0; i < n; ++i) {
    {
      auto st = p.make(64 << 20);
      times.push_back(p.round_trip_us(st));
    }
    p.context_.collect();
    p.allocator_.empty_cache();
  }
  const auto [median, p90] = summarize(times);
  std::printf("| first share of a new segment (64 MiB) | %.1f | %.1f | %s |\n", median, p90, p.steps().c_str());
}

void flat_memory(producer_side& p, const options& o) {
  std::printf("\n| storages shared and released | producer RSS KiB | consumer RSS KiB | reserved bytes | held slots | counter files | limbo |\n|---|---|---|---|---|---|---|\n");
  const auto start = clock_type::now();
  for (long i = 0; i <= o.million; ++i) {
    if (i % (o.million / 4) == 0) {
      (void)p.steps();  // and forget the step timings, so they do not count as memory
      const auto s = p.context_.stats();
      std::printf("| %ld | %zu | %zu | %lld | %zu | %zu | %zu |\n", i, resident_kib(), p.consumer_rss_kib(),
                  static_cast<long long>(p.allocator_.stats().reserved_bytes.aggregate.current), s.held_slots,
                  s.counter_files, s.limbo_blocks);
    }
    if (i == o.million) break;
    auto st = p.make(4 << 10);
    (void)p.round_trip_us(st);
  }
  const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  std::printf("\n%ld storages in %.1f s: %.1f us each, all steps included\n", o.million, seconds, seconds * 1e6 / o.million);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 6 && std::string(argv[1]) == "--consume") {
      return consume(argv[2], std::stoul(argv[3]), std::stol(argv[4]), std::stol(argv[5]));
    }
    options o;
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string flag = argv[i];
      if (flag == "--backend") o.backend = argv[i + 1];
      else if (flag == "--iterations") o.iterations = std::atoi(argv[i + 1]);
      else if (flag == "--million") o.million = std::atol(argv[i + 1]);
      else if (flag == "--ring-bytes") o.ring_bytes = std::stoul(argv[i + 1]);
      else if (flag == "--breakdown") o.breakdown = std::string(argv[i + 1]) == "1";
      else if (flag == "--import-answer-spin-us") o.import_answer_spin_us = std::atol(argv[i + 1]);
      else if (flag == "--consumer-receive-spin-us") o.consumer_receive_spin_us = std::atol(argv[i + 1]);
      else if (flag == "--consumer-collect-ms") o.consumer_collect_ms = std::atol(argv[i + 1]);
      else throw invalid_argument("unknown flag " + flag);
    }
    backend::device& dev = device_named(o.backend);
    std::printf("shoal IPC benchmark: backend %s (%s), %s, import answer spin %ld us, consumer receive spin %ld us, consumer collects every %ld ms\n\n| what | median us | p90 us | medians: send, then in the consumer send+receive (from the send call), touch, drop (us) |\n|---|---|---|---|\n",
                o.backend.c_str(), dev.name().c_str(),
                o.ring_bytes > 0 ? ("rings of " + std::to_string(o.ring_bytes) + " bytes").c_str() : "the socket alone",
                o.import_answer_spin_us, o.consumer_receive_spin_us, o.consumer_collect_ms);
    producer_side p(dev, "/proc/self/exe", o);
    round_trips(p, o, {"round trip, segment open, 4 KiB", std::size_t{4} << 10});
    round_trips(p, o, {"round trip, segment open, 64 MiB", std::size_t{64} << 20});
    first_shares(p, o);
    round_trip_floor(p, o);
    if (o.breakdown) round_trip_breakdown(p, o);
    flat_memory(p, o);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shoal_bench_ipc: %s\n", e.what());
    return 1;
  }
}
