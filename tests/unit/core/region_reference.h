// Brute-force references for regions (core/layout/region.h), shared by the tests of the region
// algebra and of the copy planner: every answer is decided element by element from a region's
// defining numbers, never from Runs() or Overlap().
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "core/layout/region.h"

namespace ucp::testing {

// Reference: does flat element `index` of a tensor of `shape` belong to `region`? Decides from
// the region's defining numbers, not from Runs().
inline bool Contains(const Region& region, const Shape& shape, uint64_t index) {
  if (region.kind() == Region::Kind::kFlat) {
    return index >= region.bounds().begin && index < region.bounds().end;
  }
  for (size_t d = shape.size(); d > 0; --d) {
    const uint64_t coordinate = index % shape[d - 1];
    index /= shape[d - 1];
    if (coordinate < region.offsets()[d - 1] ||
        coordinate >= region.offsets()[d - 1] + region.extents()[d - 1]) {
      return false;
    }
  }
  return true;
}

inline uint64_t Numel(const Shape& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

// The region's elements in storage order (ascending flat index for both kinds).
inline std::vector<uint64_t> Elements(const Region& region) {
  std::vector<uint64_t> out;
  for (uint64_t i = 0; i < Numel(region.shape()); ++i) {
    if (Contains(region, region.shape(), i)) out.push_back(i);
  }
  return out;
}

inline Region RandomRegion(std::mt19937& rng, const Shape& shape) {
  const uint64_t numel = Numel(shape);
  if (rng() % 2 == 0) {
    uint64_t a = rng() % (numel + 1);
    uint64_t b = rng() % (numel + 1);
    if (a > b) std::swap(a, b);
    return Region::Flat(a, b, shape).value();
  }
  std::vector<uint64_t> offsets(shape.size());
  std::vector<uint64_t> extents(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    // Favour full dimensions so that trailing-dimension collapsing is exercised.
    if (rng() % 3 == 0) {
      offsets[d] = 0;
      extents[d] = shape[d];
    } else {
      offsets[d] = rng() % (shape[d] + 1);
      extents[d] = rng() % (shape[d] - offsets[d] + 1);
    }
  }
  return Region::Box(offsets, extents, shape).value();
}

inline Shape RandomShape(std::mt19937& rng) {
  Shape shape(rng() % 4);
  for (uint64_t& d : shape) d = 1 + rng() % 5;
  return shape;
}

}  // namespace ucp::testing
