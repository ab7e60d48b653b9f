// Tests core/plan/copy_plan.cc against a brute-force reference: for every element of the
// wanted region, in its storage order, the file and byte offset of the one fragment element
// that holds it.
#include "core/plan/copy_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "region_reference.h"

namespace ucp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint64_t kFileSize = 1 << 20;

using testing::Elements;
using testing::Numel;
using testing::RandomRegion;

struct ByteSource {
  uint32_t file;
  uint64_t offset;
  bool operator==(const ByteSource&) const = default;
};

std::vector<ByteSource> Expand(const std::vector<Segment>& segments) {
  std::vector<ByteSource> out;
  for (const Segment& segment : segments) {
    for (uint64_t k = 0; k < segment.length; ++k) {
      out.push_back({segment.file, segment.zero_fill() ? 0 : segment.offset + k});
    }
  }
  return out;
}

std::vector<ByteSource> Reference(const Atom& atom, const Region& region) {
  const uint64_t itemsize = ItemSize(atom.dtype);
  std::vector<ByteSource> out;
  for (const uint64_t element : Elements(region)) {
    for (const Fragment& fragment : atom.fragments) {
      const std::vector<uint64_t> held = Elements(fragment.region);
      const auto it = std::find(held.begin(), held.end(), element);
      if (it == held.end()) continue;
      const uint64_t position = static_cast<uint64_t>(it - held.begin());
      for (uint64_t k = 0; k < itemsize; ++k) {
        out.push_back({fragment.file, fragment.offset + position * itemsize + k});
      }
    }
  }
  return out;
}

AtomIndex MakeIndex(std::vector<Atom> atoms, uint32_t files) {
  AtomIndexContents c;
  c.framework = "test";
  c.adapter = "test";
  c.tag = "t";
  for (uint32_t f = 0; f < files; ++f) {
    c.files.push_back({"f" + std::to_string(f), kFileSize, 0, "data", std::nullopt});
  }
  c.atoms = std::move(atoms);
  return AtomIndex::Create(std::move(c)).value();
}

// Fragments tiling `shape`: flat cuts, or a grid of boxes over the first two dimensions. Each
// lands in a random file at a random, increasing offset.
std::vector<Fragment> RandomFragments(std::mt19937& rng, const Shape& shape, DType dtype,
                                      uint32_t files) {
  std::vector<Region> regions;
  const uint64_t numel = Numel(shape);
  if (shape.size() < 2 || rng() % 2 == 0) {
    std::vector<uint64_t> cuts = {0, numel};
    for (uint32_t c = rng() % 4; c > 0; --c) cuts.push_back(rng() % (numel + 1));
    std::sort(cuts.begin(), cuts.end());
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      regions.push_back(Region::Flat(cuts[c], cuts[c + 1], shape).value());
    }
  } else {
    const auto cuts_of = [&](uint64_t dim) {
      std::vector<uint64_t> cuts = {0, dim};
      if (rng() % 2 == 0) cuts.push_back(rng() % (dim + 1));
      std::sort(cuts.begin(), cuts.end());
      cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
      return cuts;
    };
    const std::vector<uint64_t> rows = cuts_of(shape[0]);
    const std::vector<uint64_t> cols = cuts_of(shape[1]);
    for (size_t r = 0; r + 1 < rows.size(); ++r) {
      for (size_t c = 0; c + 1 < cols.size(); ++c) {
        std::vector<uint64_t> offsets(shape.size(), 0);
        std::vector<uint64_t> extents(shape.begin(), shape.end());
        offsets[0] = rows[r];
        extents[0] = rows[r + 1] - rows[r];
        offsets[1] = cols[c];
        extents[1] = cols[c + 1] - cols[c];
        regions.push_back(Region::Box(offsets, extents, shape).value());
      }
    }
  }
  std::vector<Fragment> fragments;
  std::vector<uint64_t> cursor(files, 0);
  for (Region& region : regions) {
    const uint32_t file = rng() % files;
    // Sometimes back to back with the previous fragment of the file, so merges happen.
    cursor[file] += (rng() % 2) * ItemSize(dtype);
    fragments.push_back({file, cursor[file], dtype, region});
    cursor[file] += region.numel() * ItemSize(dtype);
  }
  return fragments;
}

TEST(CopyPlanTest, FlatFragmentsOfAFlatPartition) {
  const Shape shape{10};
  Atom atom{"p",
            "fp32",
            DType::kFloat32,
            shape,
            {{0, 100, DType::kFloat32, Region::Flat(0, 4, shape).value()},
             {1, 0, DType::kFloat32, Region::Flat(4, 10, shape).value()}}};
  const AtomIndex index = MakeIndex({atom}, 2);
  const Atom& a = *index.Find("p", "fp32");
  EXPECT_THAT(PlanRegion(index, a, Region::Flat(2, 7, shape).value()).value(),
              ElementsAre(Segment{0, 108, 8}, Segment{1, 0, 12}));
  EXPECT_THAT(PlanRegion(index, a, Region::Whole(shape).value()).value(),
              ElementsAre(Segment{0, 100, 16}, Segment{1, 0, 24}));
  EXPECT_TRUE(PlanRegion(index, a, Region::Flat(3, 3, shape).value()).value().empty());
}

TEST(CopyPlanTest, AdjacentFragmentsMerge) {
  const Shape shape{10};
  Atom atom{"p",
            "bit16",
            DType::kBFloat16,
            shape,
            {{0, 40, DType::kBFloat16, Region::Flat(5, 10, shape).value()},
             {0, 30, DType::kBFloat16, Region::Flat(0, 5, shape).value()}}};
  const AtomIndex index = MakeIndex({atom}, 1);
  EXPECT_THAT(PlanRegion(index, *index.Find("p", "bit16"), Region::Whole(shape).value()).value(),
              ElementsAre(Segment{0, 30, 20}));
}

TEST(CopyPlanTest, BoxFragmentsOfAFlatRange) {
  const Shape shape{4, 6};
  // Column halves stored separately: a flat range needs alternating pieces of both.
  Atom atom{"w",
            "fp32",
            DType::kFloat32,
            shape,
            {{0, 0, DType::kFloat32, Region::Box({0, 0}, {4, 3}, shape).value()},
             {1, 0, DType::kFloat32, Region::Box({0, 3}, {4, 3}, shape).value()}}};
  const AtomIndex index = MakeIndex({atom}, 2);
  EXPECT_THAT(
      PlanRegion(index, *index.Find("w", "fp32"), Region::Flat(4, 13, shape).value()).value(),
      ElementsAre(Segment{1, 4, 8}, Segment{0, 12, 12}, Segment{1, 12, 12}, Segment{0, 24, 4}));
}

TEST(CopyPlanTest, RandomAgainstReference) {
  std::mt19937 rng(5);
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kInt64, DType::kUInt8};
  for (int trial = 0; trial < 800; ++trial) {
    Shape shape(1 + rng() % 3);
    for (uint64_t& d : shape) d = 1 + rng() % 6;
    const DType dtype = dtypes[rng() % 4];
    const uint32_t files = 1 + rng() % 3;
    Atom atom{"p", "s", dtype, shape, RandomFragments(rng, shape, dtype, files)};
    const AtomIndex index = MakeIndex({atom}, files);
    const Atom& indexed = *index.Find("p", "s");
    for (int r = 0; r < 4; ++r) {
      const Region region = RandomRegion(rng, shape);
      const std::vector<Segment> segments = PlanRegion(index, indexed, region).value();
      ASSERT_EQ(Expand(segments), Reference(indexed, region)) << region.ToString();
      for (size_t s = 0; s < segments.size(); ++s) {
        ASSERT_GT(segments[s].length, 0u);
        if (s > 0) {
          const Segment& last = segments[s - 1];
          ASSERT_FALSE(last.file == segments[s].file &&
                       last.offset + last.length == segments[s].offset)
              << "unmerged seam in " << region.ToString();
        }
      }
    }
  }
}

TEST(CopyPlanTest, Errors) {
  const Shape shape{4};
  Atom atom{
      "p", "fp32", DType::kFloat32, shape, {{0, 0, DType::kFloat32, Region::Whole(shape).value()}}};
  const AtomIndex index = MakeIndex({atom}, 1);
  const Atom& a = *index.Find("p", "fp32");
  const Status other_shape = PlanRegion(index, a, Region::Whole(Shape{2, 2}).value()).status();
  EXPECT_EQ(other_shape.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(other_shape.message(), HasSubstr("plan p/fp32 flat[0,4)"));

  // Atoms outside the index's validation: a converting fragment, a file the index lacks, a hole.
  Atom converting = a;
  converting.fragments[0].dtype = DType::kFloat16;
  EXPECT_EQ(PlanRegion(index, converting, Region::Whole(shape).value()).status().code(),
            StatusCode::kFailedPrecondition);
  Atom elsewhere = a;
  elsewhere.fragments[0].file = 1;
  EXPECT_EQ(PlanRegion(index, elsewhere, Region::Whole(shape).value()).status().code(),
            StatusCode::kInvalidArgument);
  Atom holed = a;
  holed.fragments[0].region = Region::Flat(0, 3, shape).value();
  const Status hole = PlanRegion(index, holed, Region::Flat(1, 4, shape).value()).status();
  EXPECT_EQ(hole.code(), StatusCode::kNotFound);
  EXPECT_THAT(hole.message(), HasSubstr("element 2 of the region is held by no fragment"));
}

TEST(CopyPlanTest, SegmentHelpers) {
  std::vector<Segment> segments;
  AppendZeros(segments, 0);
  EXPECT_TRUE(segments.empty());
  AppendSegments(segments, std::vector<Segment>{{2, 10, 5}, {2, 15, 5}, {2, 30, 1}});
  AppendZeros(segments, 3);
  AppendZeros(segments, 4);
  AppendSegments(segments, std::vector<Segment>{{Segment::kZeroFill, 0, 1}, {1, 0, 2}});
  EXPECT_THAT(segments, ElementsAre(Segment{2, 10, 10}, Segment{2, 30, 1},
                                    Segment{Segment::kZeroFill, 0, 8}, Segment{1, 0, 2}));
  EXPECT_EQ(SegmentBytes(segments), 21u);
}

TEST(CopyPlanTest, WidenedSegmentsMergeOnlyWithWidenedOnesThatContinueTheirSource) {
  std::vector<Segment> segments;
  // 8 output bytes of a widened segment read 4 source bytes: [10, 14) continues at 14.
  AppendSegments(segments,
                 std::vector<Segment>{
                     {2, 10, 8, true}, {2, 14, 4, true}, {2, 16, 4, false}, {2, 20, 8, true}});
  EXPECT_THAT(segments, ElementsAre(Segment{2, 10, 12, true}, Segment{2, 16, 4, false},
                                    Segment{2, 20, 8, true}));
  EXPECT_EQ(segments.front().source_length(), 6u);
  EXPECT_EQ(SegmentBytes(segments), 24u);
}

}  // namespace
}  // namespace ucp
