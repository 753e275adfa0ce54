// The daemon log's text form (tools/shoal/daemon_log.h): a value is written
// bare only when it is printable ASCII with no space, quote or '='; any other
// is quoted with JSON's escapes. A value can carry a peer's words (a
// connection's detail), so no record may span two lines, forge a field, or
// put a terminal escape or a byte that is no text on the operator's screen.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "tools/shoal/daemon_log.h"

namespace shoal::testing {
namespace {

using tools::daemon_log;
using tools::log_field;

// The lines the log wrote for one record of `fields`, once it drained.
std::vector<std::string> lines_logged(bool json, std::initializer_list<log_field> fields) {
  ::testing::internal::CaptureStderr();
  {
    daemon_log log(json);
    log.info(fields);
  }
  std::vector<std::string> lines;
  std::istringstream in(::testing::internal::GetCapturedStderr());
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

bool printable_ascii(const std::string& line) {
  for (const char c : line) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) return false;
  }
  return true;
}

const std::string hostile = "no\nforged=1 \x1b[2J\xff\x7f\"q\"\\";
const std::string hostile_escaped = R"("no\nforged=1 \u001b[2J\u00ff\u007f\"q\"\\")";

TEST(daemon_log_text, a_value_that_is_no_printable_word_is_quoted_with_escapes_on_one_line) {
  const auto lines = lines_logged(false, {{"event", "refused"}, {"detail", hostile}});
  ASSERT_EQ(lines.size(), 1U) << "the record spans lines";
  EXPECT_TRUE(printable_ascii(lines[0])) << lines[0];
  const std::string tail = " event=refused detail=" + hostile_escaped;
  ASSERT_GE(lines[0].size(), tail.size());
  EXPECT_EQ(lines[0].substr(lines[0].size() - tail.size()), tail);
}

TEST(daemon_log_text, a_printable_word_is_written_bare_and_an_empty_value_quoted) {
  const auto lines = lines_logged(false, {{"event", "lent"}, {"detail", ""}, {"name", "a.b-c/d"}});
  ASSERT_EQ(lines.size(), 1U);
  const std::string tail = " event=lent detail=\"\" name=a.b-c/d";
  ASSERT_GE(lines[0].size(), tail.size());
  EXPECT_EQ(lines[0].substr(lines[0].size() - tail.size()), tail);
}

TEST(daemon_log_text, a_json_record_escapes_the_same_value_as_a_string) {
  const auto lines = lines_logged(true, {{"event", "refused"}, {"detail", hostile}});
  ASSERT_EQ(lines.size(), 1U) << "the record spans lines";
  EXPECT_TRUE(printable_ascii(lines[0])) << lines[0];
  const std::string tail = "\"event\":\"refused\",\"detail\":" + hostile_escaped + "}";
  ASSERT_GE(lines[0].size(), tail.size());
  EXPECT_EQ(lines[0].substr(lines[0].size() - tail.size()), tail);
}

}  // namespace
}  // namespace shoal::testing
