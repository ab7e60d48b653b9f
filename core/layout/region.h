// Regions of an atom (one global, row-major N-d tensor) and their algebra.
//
// A Region names a set of elements of a tensor of a given shape, in one of two forms:
//   flat  [begin, end)                elements begin .. end-1 of the row-major linearisation
//                                     (ZeRO-1/2 partitions cut tensors this way)
//   box   offsets[d], extents[d]      the sub-tensor offsets[d] <= i_d < offsets[d] + extents[d]
//                                     for every dimension d (tensor-parallel slices)
// A region's elements are *stored* in its own order: a flat region's in index order, a box's
// row-major over the box. Both orders are ascending in the tensor's flat index, so every region is
// also a sorted list of disjoint flat runs of the tensor (Runs), and all the algebra here works on
// those runs: an overlap of two regions is a list of pieces, each a flat run of the tensor with its
// position inside either region's storage order.
//
// A Region cannot exist invalid: Create* check every bound against the shape with checked
// arithmetic. A 0-d tensor (shape {}) has one element; flat [0, 1) and the empty box cover it.
//
// Thread-safety: values; pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/util/status.h"

namespace ucp {

using Shape = std::vector<uint64_t>;

// Elements of `shape` (1 for {}), or kOutOfRange when the product overflows 64 bits.
[[nodiscard]] Result<uint64_t> NumElements(std::span<const uint64_t> shape);

// A half-open run of flat element indices.
struct FlatRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
  bool operator==(const FlatRange&) const = default;
};

class Region {
 public:
  enum class Kind : uint8_t { kFlat, kBox };

  // [begin, end) of a tensor of `shape`: kInvalidArgument unless begin <= end <= numel.
  static Result<Region> Flat(uint64_t begin, uint64_t end, std::span<const uint64_t> shape);
  // The box of a tensor of `shape`: kInvalidArgument unless offsets and extents have one entry per
  // dimension and offsets[d] + extents[d] <= shape[d] for every d.
  static Result<Region> Box(std::vector<uint64_t> offsets, std::vector<uint64_t> extents,
                            std::span<const uint64_t> shape);
  // Every element of a tensor of `shape`, as a flat region.
  static Result<Region> Whole(std::span<const uint64_t> shape);

  Kind kind() const { return kind_; }
  // The shape this region was validated against.
  const Shape& shape() const { return shape_; }
  // kFlat: the range. kBox: the flat range from its first to one past its last element.
  FlatRange bounds() const;
  // kBox only (empty vectors for kFlat).
  const std::vector<uint64_t>& offsets() const { return offsets_; }
  const std::vector<uint64_t>& extents() const { return extents_; }
  // Elements in the region.
  uint64_t numel() const { return numel_; }
  // The region as maximal flat runs of the tensor, ascending (a box whose trailing dimensions
  // are full collapses to fewer, longer runs). Empty for an empty region.
  std::vector<FlatRange> Runs() const;
  // "flat[0,100)" or "box[0:2,4:8]" (offset:end per dimension), for messages.
  std::string ToString() const;

  bool operator==(const Region&) const = default;

 private:
  Region() = default;

  Kind kind_ = Kind::kFlat;
  Shape shape_;
  uint64_t begin_ = 0;  // kFlat
  uint64_t end_ = 0;    // kFlat
  std::vector<uint64_t> offsets_;
  std::vector<uint64_t> extents_;
  uint64_t numel_ = 0;
};

// One piece of the overlap of two regions `a` and `b` of the same tensor: `length` elements that
// sit at element `a_position` of a's storage order and at `b_position` of b's, and at flat
// index `tensor_begin` of the tensor.
struct OverlapPiece {
  uint64_t tensor_begin = 0;
  uint64_t a_position = 0;
  uint64_t b_position = 0;
  uint64_t length = 0;
  bool operator==(const OverlapPiece&) const = default;
};

// The elements `a` and `b` share, as maximal pieces in ascending tensor order (adjacent pieces
// are merged when they are contiguous in the tensor and in both storage orders).
// kInvalidArgument when the regions belong to different shapes.
[[nodiscard]] Result<std::vector<OverlapPiece>> Overlap(const Region& a, const Region& b);

// The intersection of two boxes of the same shape, or an empty box (numel 0) when disjoint.
// kInvalidArgument when either is not a box or the shapes differ.
[[nodiscard]] Result<Region> IntersectBoxes(const Region& a, const Region& b);

// OK when `regions` (all of `shape`) together hold every element of `shape` exactly once.
// Otherwise kInvalidArgument naming the first element that is missing or held twice, and the
// regions involved (by index into `regions`).
[[nodiscard]] Status CheckTiling(std::span<const Region> regions, std::span<const uint64_t> shape);

}  // namespace ucp
