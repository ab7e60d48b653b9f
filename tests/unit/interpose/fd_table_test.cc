#include "interpose/fd_table.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <set>
#include <thread>
#include <vector>

namespace ucp {
namespace {

std::vector<int> UntrackAll(FdTable& table, unsigned first, unsigned last) {
  std::vector<int> fds;
  table.UntrackRange(first, last, [&](int fd) { fds.push_back(fd); });
  return fds;
}

TEST(FdTableTest, TrackAndUntrack) {
  FdTable table;
  EXPECT_FALSE(table.MaybeTracked(5));
  EXPECT_FALSE(table.MaybeTracked(-1));
  EXPECT_TRUE(table.Track(5));
  EXPECT_TRUE(table.MaybeTracked(5));
  EXPECT_TRUE(table.IsTracked(5));
  EXPECT_FALSE(table.IsTracked(4));
  EXPECT_FALSE(table.IsTracked(6));
  EXPECT_FALSE(table.Track(-3));
  EXPECT_TRUE(table.Untrack(5));
  EXPECT_FALSE(table.Untrack(5));
  EXPECT_FALSE(table.MaybeTracked(5));
}

TEST(FdTableTest, WordBoundaries) {
  FdTable table;
  const std::set<int> tracked = {0, 63, 64, 127, 128, FdTable::kDirectFds - 1};
  for (int fd : tracked) EXPECT_TRUE(table.Track(fd));
  for (int fd = 0; fd < FdTable::kDirectFds; ++fd) {
    ASSERT_EQ(table.IsTracked(fd), tracked.count(fd) == 1) << fd;
  }
  EXPECT_EQ(UntrackAll(table, 0, ~0U), std::vector<int>(tracked.begin(), tracked.end()));
  for (int fd : tracked) EXPECT_FALSE(table.MaybeTracked(fd));
}

TEST(FdTableTest, FdsBeyondTheBitmap) {
  FdTable table;
  const int high = FdTable::kDirectFds + 10;
  EXPECT_FALSE(table.MaybeTracked(high));
  EXPECT_TRUE(table.Track(high));
  EXPECT_TRUE(table.MaybeTracked(high));
  EXPECT_TRUE(table.IsTracked(high));
  // A high fd makes every high fd "maybe"; IsTracked is exact.
  EXPECT_TRUE(table.MaybeTracked(high + 1));
  EXPECT_FALSE(table.IsTracked(high + 1));
  EXPECT_TRUE(table.Untrack(high));
  EXPECT_FALSE(table.Untrack(high));
  EXPECT_FALSE(table.MaybeTracked(high + 1));
}

TEST(FdTableTest, UntrackRangeHonoursBounds) {
  FdTable table;
  const int high = FdTable::kDirectFds + 5;
  for (int fd : {3, 4, 70, 200, high, high + 100}) table.Track(fd);
  EXPECT_EQ(UntrackAll(table, 4, 70), (std::vector<int>{4, 70}));
  EXPECT_TRUE(table.IsTracked(3));
  EXPECT_TRUE(table.IsTracked(200));
  EXPECT_EQ(UntrackAll(table, 71, 199), std::vector<int>{});
  std::vector<int> rest = UntrackAll(table, 200, static_cast<unsigned>(high));
  EXPECT_EQ(rest, (std::vector<int>{200, high}));
  EXPECT_TRUE(table.IsTracked(high + 100));
  EXPECT_EQ(UntrackAll(table, 5, 4), std::vector<int>{});
  EXPECT_EQ(UntrackAll(table, 0, ~0U), (std::vector<int>{3, high + 100}));
}

TEST(FdTableTest, ManyHighFdsInOneRange) {
  FdTable table;
  std::vector<int> expected;
  for (int i = 0; i < 200; ++i) {
    table.Track(FdTable::kDirectFds + i);
    expected.push_back(FdTable::kDirectFds + i);
  }
  std::vector<int> got = UntrackAll(table, FdTable::kDirectFds, ~0U);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, expected);
  EXPECT_FALSE(table.MaybeTracked(FdTable::kDirectFds));
}

TEST(FdTableTest, ExactlyOneConcurrentUntrackWins) {
  FdTable table;
  constexpr int kFds = 512;
  constexpr int kThreads = 8;
  for (int round = 0; round < 20; ++round) {
    for (int fd = 0; fd < kFds; ++fd) table.Track(fd);
    std::atomic<int> wins{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&] {
        for (int fd = 0; fd < kFds; ++fd) {
          if (table.Untrack(fd)) wins.fetch_add(1);
        }
      });
    }
    for (auto& thread : threads) thread.join();
    EXPECT_EQ(wins.load(), kFds);
  }
}

TEST(FdTableTest, ConcurrentNeighboursDoNotDisturbEachOther) {
  // Threads own disjoint fds that share bitmap words; each sees only its own state.
  FdTable table;
  constexpr int kThreads = 8;
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20000; ++i) {
        const int fd = (i % 16) * kThreads + t;
        if (!table.Track(fd) || !table.IsTracked(fd)) errors.fetch_add(1);
        if (!table.Untrack(fd) || table.IsTracked(fd)) errors.fetch_add(1);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(errors.load(), 0);
}

}  // namespace
}  // namespace ucp
