// core::rename_exchange (how a checkpoint directory is replaced in one step): two directories swap their
// names with their contents; a missing path changes nothing and says ENOENT.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "core/rename_exchange.h"

namespace {

using shardkit::core::rename_exchange;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  std::getline(in, text);
  return text;
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text << "\n"; }

class RenameExchange : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/shardkit-rename-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    root_ = pattern;
  }
  void TearDown() override { std::system(("rm -rf '" + root_ + "'").c_str()); }
  std::string root_;
};

TEST_F(RenameExchange, SwapsTwoDirectoriesWithTheirContents) {
  const std::string old_dir = root_ + "/ckpt", new_dir = root_ + "/.ckpt.staging";
  ASSERT_EQ(mkdir(old_dir.c_str(), 0755), 0);
  ASSERT_EQ(mkdir(new_dir.c_str(), 0755), 0);
  write_file(old_dir + "/data", "old");
  write_file(new_dir + "/data", "new");
  const int result = rename_exchange(new_dir.c_str(), old_dir.c_str());
  if (result == EINVAL || result == ENOSYS || result == ENOTSUP) {
    GTEST_SKIP() << "this filesystem or kernel cannot exchange (errno " << result << ")";
  }
  ASSERT_EQ(result, 0);
  EXPECT_EQ(read_file(old_dir + "/data"), "new");
  EXPECT_EQ(read_file(new_dir + "/data"), "old");
}

TEST_F(RenameExchange, AMissingPathChangesNothing) {
  const std::string present = root_ + "/present", missing = root_ + "/missing";
  ASSERT_EQ(mkdir(present.c_str(), 0755), 0);
  const int result = rename_exchange(present.c_str(), missing.c_str());
  if (result == ENOSYS) GTEST_SKIP() << "no renameat2 here";
  EXPECT_EQ(result, ENOENT);
  struct stat info {};
  EXPECT_EQ(stat(present.c_str(), &info), 0);
  EXPECT_NE(stat(missing.c_str(), &info), 0);
}

}  // namespace
