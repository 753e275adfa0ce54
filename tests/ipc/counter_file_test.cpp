// A counter file's holder side in a forked child: a child of a consumer (a
// data loader's worker forked after a batch came) that drops or marks its
// parent's references must change nothing, since the references are the
// parent's (sharing.h: they belong to the process that connected).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ipc/counters/counter_file.h"
#include "shoal/core/process_identity.h"

namespace shoal::testing {
namespace {

using ipc::detail::counter_file;
using ipc::detail::slot_ticket;

TEST(counter_file, a_forked_child_neither_marks_nor_releases_its_parents_slot) {
  auto file = counter_file::create(8);
  const slot_ticket ticket{3, 1};
  file.claim(ticket, process_identity::self());
  ASSERT_TRUE(file.holds(ticket));
  const pid_t child = ::fork();
  if (child == 0) {
    file.mark_received(ticket);
    ::_exit(file.release(ticket) ? 1 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "release() in the child said it released";
  EXPECT_FALSE(file.taken(ticket)) << "the child marked the parent's slot received";
  EXPECT_TRUE(file.holds(ticket)) << "the child released the parent's slot";
  file.mark_received(ticket);
  EXPECT_TRUE(file.taken(ticket)) << "the owner's own mark";
  EXPECT_TRUE(file.release(ticket));
  EXPECT_TRUE(file.released(ticket));
}

}  // namespace
}  // namespace shoal::testing
