// Memory exported by one process and imported by another.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <string>

#include "shoal/core/error.h"
#include "shoal/core/child_process.h"
#include "support/fd_transport.h"
#include "support/backends.h"

namespace shoal::testing {
namespace {

template <class Backend>
class sharing : public backend_test<Backend> {
 protected:
  // Sends `handle` to a new peer process, which must find `bytes` bytes of
  // `expected` at the handle's pointer and overwrite them with `written`.
  void share_with_peer(const backend::shareable_handle& handle, std::size_t bytes, std::uint8_t expected,
                       std::uint8_t written) {
    child_process peer(SHOAL_TEST_SHARE_PEER,
                            {Backend::name, std::to_string(bytes), std::to_string(expected), std::to_string(written)});
    const auto wire = handle.serialize();
    testing::send_message(peer.socket(), wire, handle.fd.get());
    const testing::message answer = testing::receive_message(peer.socket(), 4096);
    const std::string text(reinterpret_cast<const char*>(answer.payload.data()), answer.payload.size());
    EXPECT_EQ(text, "ok");
    EXPECT_EQ(peer.wait(), 0);
  }
};
TYPED_TEST_SUITE(sharing, backend_types, backend_names);

TYPED_TEST(sharing, a_segment_is_read_and_written_by_another_process) {
  auto& dev = this->device();
  constexpr std::size_t bytes = 1 << 20;
  constexpr std::size_t offset = 64 << 10;
  auto* base = static_cast<std::uint8_t*>(dev.allocate_segment(2 << 20));
  dev.fill({}, base + offset, 0x3C, bytes);
  dev.synchronize({});
  const auto handle = dev.export_memory(base + offset);
  EXPECT_EQ(handle.offset, offset);
  EXPECT_GE(handle.size, std::size_t{2} << 20);
  this->share_with_peer(handle, bytes, 0x3C, 0xC3);
  EXPECT_TRUE(all_equal(this->read(base + offset, bytes), 0xC3));
  dev.free_segment(base);
}

TYPED_TEST(sharing, a_mapped_chunk_is_read_and_written_by_another_process) {
  auto& dev = this->device();
  const std::size_t g = dev.granularity();
  auto* range = static_cast<std::uint8_t*>(dev.reserve_range(2 * g));
  const auto chunk = dev.create_physical(g);
  dev.map(range + g, chunk);
  dev.fill({}, range + g, 0x42, g);
  dev.synchronize({});
  const auto handle = dev.export_memory(range + g + 512);
  EXPECT_EQ(handle.offset, 512u);
  EXPECT_EQ(handle.size, g);
  EXPECT_TRUE(handle.fd.valid());
  this->share_with_peer(handle, g - 512, 0x42, 0x24);
  EXPECT_TRUE(all_equal(this->read(range + g + 512, g - 512), 0x24));
  dev.unmap(range + g);
  dev.release_physical(chunk);
  dev.release_range(range);
}

TYPED_TEST(sharing, handles_that_cannot_be_imported_are_refused) {
  auto& dev = this->device();
  void* base = dev.allocate_segment(4096);
  auto handle = dev.export_memory(base);
  // A handle that claims another backend.
  backend::shareable_handle foreign;
  foreign.kind = dev.kind() == backend::device_kind::host ? backend::handle_kind::cuda_ipc : backend::handle_kind::host_memfd;
  foreign.device = dev.kind() == backend::device_kind::host ? backend::device_kind::cuda : backend::device_kind::host;
  foreign.size = 4096;
  EXPECT_THROW(dev.import_memory(foreign), invalid_argument);
  if (handle.fd.valid()) {
    handle.fd.reset();  // a closed descriptor
    EXPECT_THROW(dev.import_memory(handle), invalid_argument);
  }
  dev.free_segment(base);
}

TEST(host_sharing, exported_memory_is_sealed_against_resizing) {
  auto& dev = backend::host_device_instance();
  void* base = dev.allocate_segment(8192);
  const auto handle = dev.export_memory(base);
  EXPECT_NE(::ftruncate(handle.fd.get(), 4096), 0) << "an importer's mapping could lose its pages";
  EXPECT_NE(::ftruncate(handle.fd.get(), 1 << 20), 0);
  dev.free_segment(base);
}

TEST(host_sharing, a_descriptor_that_is_not_a_sealed_memfd_is_refused) {
  auto& dev = backend::host_device_instance();
  backend::shareable_handle handle;
  handle.kind = backend::handle_kind::host_memfd;
  handle.device = backend::device_kind::host;
  handle.size = 4096;
  handle.fd = unique_fd(::open("/dev/zero", O_RDWR | O_CLOEXEC));
  ASSERT_TRUE(handle.fd.valid());
  EXPECT_THROW(dev.import_memory(handle), invalid_argument);
}

TEST(host_sharing, a_handle_larger_than_its_file_is_refused) {
  auto& dev = backend::host_device_instance();
  void* base = dev.allocate_segment(4096);
  auto handle = dev.export_memory(base);
  handle.size = std::size_t{1} << 30;
  EXPECT_THROW(dev.import_memory(handle), invalid_argument);
  dev.free_segment(base);
}

}  // namespace
}  // namespace shoal::testing
