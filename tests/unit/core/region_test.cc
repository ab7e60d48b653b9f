// Tests core/layout/region.cc: validation, runs, and the overlap/tiling algebra against a
// brute-force reference that tests every element of the tensor one by one.
#include "core/layout/region.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "region_reference.h"

namespace ucp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using testing::Contains;
using testing::Elements;
using testing::Numel;
using testing::RandomRegion;
using testing::RandomShape;

TEST(RegionTest, NumElements) {
  EXPECT_EQ(NumElements(Shape{}).value(), 1u);
  EXPECT_EQ(NumElements(Shape{3, 0, 5}).value(), 0u);
  EXPECT_EQ(NumElements(Shape{67, 48}).value(), 3216u);
  EXPECT_EQ(NumElements(Shape{1ull << 32, 1ull << 32}).status().code(), StatusCode::kOutOfRange);
}

TEST(RegionTest, FlatValidation) {
  const Shape shape{4, 5};
  EXPECT_TRUE(Region::Flat(0, 20, shape).ok());
  EXPECT_TRUE(Region::Flat(7, 7, shape).ok());
  EXPECT_EQ(Region::Flat(0, 21, shape).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Region::Flat(5, 4, shape).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Region::Flat(0, 1, Shape{1ull << 40, 1ull << 40}).status().code(),
            StatusCode::kOutOfRange);
  const Region region = Region::Flat(3, 9, shape).value();
  EXPECT_EQ(region.numel(), 6u);
  EXPECT_EQ(region.bounds(), (FlatRange{3, 9}));
  EXPECT_EQ(region.ToString(), "flat[3,9)");
  EXPECT_THAT(region.Runs(), ElementsAre(FlatRange{3, 9}));
  EXPECT_TRUE(Region::Flat(4, 4, shape).value().Runs().empty());
}

TEST(RegionTest, BoxValidation) {
  const Shape shape{4, 5};
  EXPECT_TRUE(Region::Box({1, 2}, {3, 3}, shape).ok());
  EXPECT_TRUE(Region::Box({4, 5}, {0, 0}, shape).ok());
  EXPECT_EQ(Region::Box({1, 2}, {4, 3}, shape).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Region::Box({1}, {3}, shape).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Region::Box({1, 2}, {3}, shape).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Region::Box({~0ull, 0}, {2, 5}, shape).status().code(), StatusCode::kInvalidArgument);
  const Region box = Region::Box({1, 2}, {2, 3}, shape).value();
  EXPECT_EQ(box.numel(), 6u);
  EXPECT_EQ(box.bounds(), (FlatRange{7, 15}));
  EXPECT_EQ(box.ToString(), "box[1:3,2:5]");
}

TEST(RegionTest, ZeroDimensional) {
  const Shape scalar{};
  const Region flat = Region::Whole(scalar).value();
  const Region box = Region::Box({}, {}, scalar).value();
  EXPECT_EQ(flat.numel(), 1u);
  EXPECT_EQ(box.numel(), 1u);
  EXPECT_THAT(box.Runs(), ElementsAre(FlatRange{0, 1}));
  EXPECT_TRUE(CheckTiling(std::vector<Region>{box}, scalar).ok());
  EXPECT_TRUE(CheckTiling(std::vector<Region>{flat}, scalar).ok());
}

TEST(RegionTest, BoxRunsCollapseFullTrailingDimensions) {
  const Shape shape{3, 4, 5};
  // Last two dimensions full: one run per index of the first, and those are contiguous too.
  EXPECT_THAT(Region::Box({1, 0, 0}, {2, 4, 5}, shape).value().Runs(),
              ElementsAre(FlatRange{20, 60}));
  // Last dimension full, second partial: one run per first-dimension index.
  EXPECT_THAT(Region::Box({0, 1, 0}, {2, 2, 5}, shape).value().Runs(),
              ElementsAre(FlatRange{5, 15}, FlatRange{25, 35}));
  // Nothing full: one run per (i, j).
  EXPECT_THAT(Region::Box({1, 2, 3}, {1, 2, 2}, shape).value().Runs(),
              ElementsAre(FlatRange{33, 35}, FlatRange{38, 40}));
  EXPECT_TRUE(Region::Box({0, 0, 0}, {3, 0, 5}, shape).value().Runs().empty());
}

TEST(RegionTest, RunsMatchReference) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 2000; ++trial) {
    const Shape shape = RandomShape(rng);
    const Region region = RandomRegion(rng, shape);
    std::vector<uint64_t> from_runs;
    uint64_t previous_end = 0;
    bool first = true;
    for (const FlatRange& run : region.Runs()) {
      ASSERT_LT(run.begin, run.end) << region.ToString();
      // Maximal and ascending: a gap between consecutive runs.
      if (!first) {
        ASSERT_GT(run.begin, previous_end) << region.ToString();
      }
      first = false;
      previous_end = run.end;
      for (uint64_t i = run.begin; i < run.end; ++i) from_runs.push_back(i);
    }
    const std::vector<uint64_t> expected = Elements(region);
    ASSERT_EQ(from_runs, expected) << region.ToString();
    ASSERT_EQ(region.numel(), expected.size()) << region.ToString();
    if (!expected.empty()) {
      ASSERT_EQ(region.bounds(), (FlatRange{expected.front(), expected.back() + 1}))
          << region.ToString();
    }
  }
}

// Every (tensor index, a position, b position) the pieces describe, one per element.
struct Triple {
  uint64_t tensor, a, b;
  bool operator==(const Triple&) const = default;
};

void ExpectOverlapMatchesReference(const Region& a, const Region& b) {
  const std::vector<OverlapPiece> pieces = Overlap(a, b).value();
  std::vector<Triple> got;
  for (size_t p = 0; p < pieces.size(); ++p) {
    const OverlapPiece& piece = pieces[p];
    ASSERT_GT(piece.length, 0u);
    if (p > 0) {
      const OverlapPiece& last = pieces[p - 1];
      const bool mergeable = last.tensor_begin + last.length == piece.tensor_begin &&
                             last.a_position + last.length == piece.a_position &&
                             last.b_position + last.length == piece.b_position;
      ASSERT_FALSE(mergeable) << a.ToString() << " x " << b.ToString();
    }
    for (uint64_t k = 0; k < piece.length; ++k) {
      got.push_back({piece.tensor_begin + k, piece.a_position + k, piece.b_position + k});
    }
  }
  const std::vector<uint64_t> a_elements = Elements(a);
  const std::vector<uint64_t> b_elements = Elements(b);
  std::vector<Triple> expected;
  for (size_t i = 0; i < a_elements.size(); ++i) {
    for (size_t j = 0; j < b_elements.size(); ++j) {
      if (a_elements[i] == b_elements[j]) expected.push_back({a_elements[i], i, j});
    }
  }
  ASSERT_EQ(got, expected) << a.ToString() << " x " << b.ToString();
}

TEST(RegionTest, OverlapFlatFlat) {
  const Shape shape{100};
  const Region a = Region::Flat(10, 50, shape).value();
  const Region b = Region::Flat(30, 80, shape).value();
  EXPECT_THAT(Overlap(a, b).value(), ElementsAre(OverlapPiece{30, 20, 0, 20}));
  EXPECT_TRUE(Overlap(a, Region::Flat(50, 60, shape).value()).value().empty());
  ExpectOverlapMatchesReference(a, b);
}

TEST(RegionTest, OverlapFlatBox) {
  const Shape shape{4, 6};
  const Region flat = Region::Flat(5, 17, shape).value();
  const Region box = Region::Box({0, 2}, {4, 2}, shape).value();  // columns 2..3
  // Box elements: 2,3 | 8,9 | 14,15 | 20,21; flat holds 5..16.
  EXPECT_THAT(Overlap(flat, box).value(),
              ElementsAre(OverlapPiece{8, 3, 2, 2}, OverlapPiece{14, 9, 4, 2}));
  ExpectOverlapMatchesReference(flat, box);
  ExpectOverlapMatchesReference(box, flat);
}

TEST(RegionTest, OverlapBoxBox) {
  const Shape shape{4, 6};
  const Region a = Region::Box({1, 0}, {2, 6}, shape).value();
  const Region b = Region::Box({0, 3}, {4, 3}, shape).value();
  ExpectOverlapMatchesReference(a, b);
  EXPECT_EQ(Overlap(a, Region::Whole(Shape{24}).value()).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(RegionTest, OverlapRandomAgainstReference) {
  std::mt19937 rng(2);
  for (int trial = 0; trial < 3000; ++trial) {
    const Shape shape = RandomShape(rng);
    ExpectOverlapMatchesReference(RandomRegion(rng, shape), RandomRegion(rng, shape));
  }
}

TEST(RegionTest, IntersectBoxes) {
  const Shape shape{4, 6};
  const Region a = Region::Box({1, 0}, {2, 6}, shape).value();
  const Region b = Region::Box({0, 3}, {4, 3}, shape).value();
  const Region both = IntersectBoxes(a, b).value();
  EXPECT_EQ(both, Region::Box({1, 3}, {2, 3}, shape).value());
  const Region disjoint = IntersectBoxes(a, Region::Box({3, 0}, {1, 6}, shape).value()).value();
  EXPECT_EQ(disjoint.numel(), 0u);
  EXPECT_EQ(IntersectBoxes(a, Region::Flat(0, 3, shape).value()).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(IntersectBoxes(a, Region::Box({0}, {1}, Shape{24}).value()).status().code(),
            StatusCode::kInvalidArgument);
  std::mt19937 rng(3);
  for (int trial = 0; trial < 1000; ++trial) {
    const Shape shape_r = RandomShape(rng);
    Region x = RandomRegion(rng, shape_r);
    Region y = RandomRegion(rng, shape_r);
    if (x.kind() != Region::Kind::kBox || y.kind() != Region::Kind::kBox) continue;
    std::vector<uint64_t> expected;
    for (uint64_t i = 0; i < Numel(shape_r); ++i) {
      if (Contains(x, shape_r, i) && Contains(y, shape_r, i)) expected.push_back(i);
    }
    ASSERT_EQ(Elements(IntersectBoxes(x, y).value()), expected);
  }
}

TEST(RegionTest, CheckTilingAccepts) {
  const Shape shape{4, 6};
  std::vector<Region> rows = {Region::Box({0, 0}, {2, 6}, shape).value(),
                              Region::Box({2, 0}, {2, 6}, shape).value()};
  EXPECT_TRUE(CheckTiling(rows, shape).ok());
  std::vector<Region> mixed = {
      Region::Flat(0, 6, shape).value(), Region::Box({1, 0}, {3, 3}, shape).value(),
      Region::Box({1, 3}, {3, 3}, shape).value(), Region::Flat(24, 24, shape).value()};
  EXPECT_TRUE(CheckTiling(mixed, shape).ok());
  EXPECT_TRUE(CheckTiling(std::vector<Region>{}, Shape{0, 3}).ok());
}

TEST(RegionTest, CheckTilingNamesMissingElement) {
  const Shape shape{4, 6};
  std::vector<Region> regions = {Region::Flat(0, 9, shape).value(),
                                 Region::Flat(10, 24, shape).value()};
  const Status status = CheckTiling(regions, shape);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("element 9 [1, 3] is held by no region"));
  const Status tail = CheckTiling(std::vector<Region>{regions[0]}, shape);
  EXPECT_THAT(tail.message(), HasSubstr("element 9 [1, 3] is held by no region"));
  const Status none = CheckTiling(std::vector<Region>{}, shape);
  EXPECT_THAT(none.message(), HasSubstr("element 0 [0, 0] is held by no region"));
}

TEST(RegionTest, CheckTilingNamesDoubleElement) {
  const Shape shape{4, 6};
  std::vector<Region> regions = {Region::Box({0, 0}, {4, 3}, shape).value(),
                                 Region::Box({0, 2}, {4, 4}, shape).value()};
  const Status status = CheckTiling(regions, shape);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("element 2 [0, 2] is held twice, by regions 0"));
  EXPECT_THAT(status.message(), HasSubstr("and 1 (box[0:4,2:6])"));
  std::vector<Region> wrong_shape = {Region::Whole(Shape{24}).value()};
  EXPECT_EQ(CheckTiling(wrong_shape, shape).code(), StatusCode::kInvalidArgument);
}

TEST(RegionTest, CheckTilingRandomAgainstReference) {
  std::mt19937 rng(4);
  for (int trial = 0; trial < 2000; ++trial) {
    const Shape shape = RandomShape(rng);
    std::vector<Region> regions;
    if (trial % 2 == 0) {
      // A flat tiling from random cuts, sometimes damaged by moving one cut.
      std::vector<uint64_t> cuts = {0, Numel(shape)};
      for (uint32_t c = rng() % 4; c > 0; --c) cuts.push_back(rng() % (Numel(shape) + 1));
      std::sort(cuts.begin(), cuts.end());
      for (size_t c = 0; c + 1 < cuts.size(); ++c) {
        uint64_t begin = cuts[c];
        if (c > 0 && rng() % 4 == 0 && begin > 0) --begin;
        regions.push_back(Region::Flat(begin, cuts[c + 1], shape).value());
      }
    } else {
      for (uint32_t r = rng() % 4; r > 0; --r) regions.push_back(RandomRegion(rng, shape));
    }
    std::vector<int> count(Numel(shape), 0);
    for (const Region& region : regions) {
      for (uint64_t i : Elements(region)) ++count[i];
    }
    bool tiles = true;
    for (int c : count) tiles = tiles && c == 1;
    ASSERT_EQ(CheckTiling(regions, shape).ok(), tiles);
  }
}

}  // namespace
}  // namespace ucp
