#include "core/layout/region.h"

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>

#include "core/util/checked.h"

namespace ucp {
namespace {

std::string ShapeString(std::span<const uint64_t> shape) {
  std::string out = "[";
  for (size_t d = 0; d < shape.size(); ++d) {
    if (d > 0) out += ", ";
    out += std::to_string(shape[d]);
  }
  return out + "]";
}

// Row-major strides in elements. The caller has checked that the element count fits in 64 bits,
// so no product here overflows.
std::vector<uint64_t> Strides(std::span<const uint64_t> shape) {
  std::vector<uint64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d > 1; --d) strides[d - 2] = strides[d - 1] * shape[d - 1];
  return strides;
}

// The multi-index of flat element `index`, as "[i0, i1, ...]".
std::string IndexString(uint64_t index, std::span<const uint64_t> shape) {
  const std::vector<uint64_t> strides = Strides(shape);
  std::vector<uint64_t> coordinates(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    coordinates[d] = index / strides[d];
    index %= strides[d];
  }
  return ShapeString(coordinates);
}

// A region's runs, each with its position in the region's storage order.
struct PositionedRun {
  FlatRange range;
  uint64_t position;
};

std::vector<PositionedRun> PositionedRuns(const Region& region) {
  std::vector<PositionedRun> out;
  uint64_t position = 0;
  for (const FlatRange& run : region.Runs()) {
    out.push_back({run, position});
    position += run.size();
  }
  return out;
}

// The first run of `runs` at or after `from` that ends after `begin`.
size_t SkipRunsBefore(const std::vector<PositionedRun>& runs, size_t from, uint64_t begin) {
  return static_cast<size_t>(
      std::upper_bound(
          runs.begin() + static_cast<std::ptrdiff_t>(from), runs.end(), begin,
          [](uint64_t value, const PositionedRun& run) { return value < run.range.end; }) -
      runs.begin());
}

}  // namespace

Result<uint64_t> NumElements(std::span<const uint64_t> shape) {
  uint64_t numel = 1;
  for (const uint64_t dim : shape) {
    const std::optional<uint64_t> product = CheckedMul(numel, dim);
    if (!product) {
      return Status::OutOfRange("shape " + ShapeString(shape) + ": element count overflows");
    }
    numel = *product;
  }
  return numel;
}

Result<Region> Region::Flat(uint64_t begin, uint64_t end, std::span<const uint64_t> shape) {
  UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(shape));
  if (begin > end || end > numel) {
    return Status::InvalidArgument(
        "region flat[" + std::to_string(begin) + "," + std::to_string(end) +
        ") does not fit shape " + ShapeString(shape) + " (" + std::to_string(numel) + " elements)");
  }
  Region region;
  region.kind_ = Kind::kFlat;
  region.shape_.assign(shape.begin(), shape.end());
  region.begin_ = begin;
  region.end_ = end;
  region.numel_ = end - begin;
  return region;
}

Result<Region> Region::Box(std::vector<uint64_t> offsets, std::vector<uint64_t> extents,
                           std::span<const uint64_t> shape) {
  UCP_RETURN_IF_ERROR(NumElements(shape).status());
  if (offsets.size() != shape.size() || extents.size() != shape.size()) {
    return Status::InvalidArgument("region box with " + std::to_string(offsets.size()) +
                                   " offsets and " + std::to_string(extents.size()) +
                                   " extents for shape " + ShapeString(shape));
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (!RangeWithin(offsets[d], extents[d], shape[d])) {
      return Status::InvalidArgument("region box offsets " + ShapeString(offsets) + " extents " +
                                     ShapeString(extents) + ": dimension " + std::to_string(d) +
                                     " exceeds shape " + ShapeString(shape));
    }
  }
  Region region;
  region.kind_ = Kind::kBox;
  region.shape_.assign(shape.begin(), shape.end());
  // Extents are bounded by the shape, whose element count fits.
  region.numel_ = 1;
  for (const uint64_t extent : extents) region.numel_ *= extent;
  region.offsets_ = std::move(offsets);
  region.extents_ = std::move(extents);
  return region;
}

Result<Region> Region::Whole(std::span<const uint64_t> shape) {
  UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(shape));
  return Flat(0, numel, shape);
}

FlatRange Region::bounds() const {
  if (kind_ == Kind::kFlat) return {begin_, end_};
  if (numel_ == 0) return {0, 0};
  const std::vector<uint64_t> strides = Strides(shape_);
  uint64_t first = 0;
  uint64_t last = 0;
  for (size_t d = 0; d < shape_.size(); ++d) {
    first += offsets_[d] * strides[d];
    last += (offsets_[d] + extents_[d] - 1) * strides[d];
  }
  return {first, last + 1};
}

std::vector<FlatRange> Region::Runs() const {
  std::vector<FlatRange> runs;
  if (numel_ == 0) return runs;
  if (kind_ == Kind::kFlat) {
    runs.push_back({begin_, end_});
    return runs;
  }
  // Trailing dimensions the box spans fully are contiguous with the first partial dimension
  // before them: one run per index of the dimensions in front of that one.
  size_t inner_dim = shape_.size();  // first dimension of the contiguous suffix
  uint64_t run_length = 1;
  while (inner_dim > 0) {
    const size_t d = inner_dim - 1;
    run_length *= extents_[d];
    inner_dim = d;
    if (offsets_[d] != 0 || extents_[d] != shape_[d]) break;
  }
  const std::vector<uint64_t> strides = Strides(shape_);
  uint64_t count = 1;
  for (size_t d = 0; d < inner_dim; ++d) count *= extents_[d];
  runs.reserve(static_cast<size_t>(count));
  std::vector<uint64_t> index(offsets_.begin(),
                              offsets_.begin() + static_cast<ptrdiff_t>(inner_dim));
  uint64_t start = 0;
  for (size_t d = 0; d < shape_.size(); ++d) start += offsets_[d] * strides[d];
  for (uint64_t r = 0; r < count; ++r) {
    runs.push_back({start, start + run_length});
    // Odometer over the outer dimensions, moving `start` by each dimension's stride.
    for (size_t d = inner_dim; d > 0; --d) {
      const size_t k = d - 1;
      if (++index[k] < offsets_[k] + extents_[k]) {
        start += strides[k];
        break;
      }
      index[k] = offsets_[k];
      start -= (extents_[k] - 1) * strides[k];
    }
  }
  return runs;
}

std::string Region::ToString() const {
  if (kind_ == Kind::kFlat) {
    return "flat[" + std::to_string(begin_) + "," + std::to_string(end_) + ")";
  }
  std::string out = "box[";
  for (size_t d = 0; d < offsets_.size(); ++d) {
    if (d > 0) out += ",";
    out += std::to_string(offsets_[d]) + ":" + std::to_string(offsets_[d] + extents_[d]);
  }
  return out + "]";
}

Result<std::vector<OverlapPiece>> Overlap(const Region& a, const Region& b) {
  if (a.shape() != b.shape()) {
    return Status::InvalidArgument("overlap of " + a.ToString() + " of shape " +
                                   ShapeString(a.shape()) + " and " + b.ToString() + " of shape " +
                                   ShapeString(b.shape()) + ": different shapes");
  }
  std::vector<OverlapPiece> pieces;
  const std::vector<PositionedRun> a_runs = PositionedRuns(a);
  const std::vector<PositionedRun> b_runs = PositionedRuns(b);
  size_t i = 0;
  size_t j = 0;
  while (i < a_runs.size() && j < b_runs.size()) {
    // Jump over runs wholly before the other side's current run (a box against a narrow flat
    // range would otherwise walk every run of the box).
    i = SkipRunsBefore(a_runs, i, b_runs[j].range.begin);
    if (i == a_runs.size()) break;
    j = SkipRunsBefore(b_runs, j, a_runs[i].range.begin);
    if (j == b_runs.size()) break;
    const PositionedRun& ra = a_runs[i];
    const PositionedRun& rb = b_runs[j];
    const uint64_t begin = std::max(ra.range.begin, rb.range.begin);
    const uint64_t end = std::min(ra.range.end, rb.range.end);
    if (begin < end) {
      const OverlapPiece piece{begin, ra.position + (begin - ra.range.begin),
                               rb.position + (begin - rb.range.begin), end - begin};
      if (!pieces.empty()) {
        OverlapPiece& last = pieces.back();
        if (last.tensor_begin + last.length == piece.tensor_begin &&
            last.a_position + last.length == piece.a_position &&
            last.b_position + last.length == piece.b_position) {
          last.length += piece.length;
        } else {
          pieces.push_back(piece);
        }
      } else {
        pieces.push_back(piece);
      }
    }
    if (ra.range.end <= rb.range.end) {
      ++i;
    } else {
      ++j;
    }
  }
  return pieces;
}

Result<Region> IntersectBoxes(const Region& a, const Region& b) {
  if (a.kind() != Region::Kind::kBox || b.kind() != Region::Kind::kBox) {
    return Status::InvalidArgument("intersect " + a.ToString() + " and " + b.ToString() +
                                   ": not both boxes");
  }
  if (a.shape() != b.shape()) {
    return Status::InvalidArgument("intersect " + a.ToString() + " and " + b.ToString() +
                                   ": different shapes " + ShapeString(a.shape()) + " and " +
                                   ShapeString(b.shape()));
  }
  const size_t dims = a.shape().size();
  std::vector<uint64_t> offsets(dims);
  std::vector<uint64_t> extents(dims);
  for (size_t d = 0; d < dims; ++d) {
    const uint64_t begin = std::max(a.offsets()[d], b.offsets()[d]);
    const uint64_t end = std::min(a.offsets()[d] + a.extents()[d], b.offsets()[d] + b.extents()[d]);
    offsets[d] = begin;
    extents[d] = end > begin ? end - begin : 0;
  }
  return Region::Box(std::move(offsets), std::move(extents), a.shape());
}

Status CheckTiling(std::span<const Region> regions, std::span<const uint64_t> shape) {
  UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(shape));
  struct TaggedRun {
    FlatRange range;
    size_t region;
  };
  std::vector<TaggedRun> runs;
  for (size_t r = 0; r < regions.size(); ++r) {
    if (!std::equal(regions[r].shape().begin(), regions[r].shape().end(), shape.begin(),
                    shape.end())) {
      return Status::InvalidArgument("tiling of shape " + ShapeString(shape) + ": region " +
                                     std::to_string(r) + " (" + regions[r].ToString() +
                                     ") is of shape " + ShapeString(regions[r].shape()));
    }
    for (const FlatRange& run : regions[r].Runs()) runs.push_back({run, r});
  }
  std::sort(runs.begin(), runs.end(), [](const TaggedRun& x, const TaggedRun& y) {
    return std::tie(x.range.begin, x.range.end, x.region) <
           std::tie(y.range.begin, y.range.end, y.region);
  });
  const auto element = [&](uint64_t index) {
    return "element " + std::to_string(index) + " " + IndexString(index, shape);
  };
  uint64_t covered = 0;  // [0, covered) is held exactly once so far
  const TaggedRun* last = nullptr;
  for (const TaggedRun& run : runs) {
    if (run.range.begin > covered) {
      return Status::InvalidArgument("tiling of shape " + ShapeString(shape) + ": " +
                                     element(covered) + " is held by no region" +
                                     (last != nullptr ? " (region " + std::to_string(last->region) +
                                                            " " + regions[last->region].ToString() +
                                                            " ends before it)"
                                                      : std::string()));
    }
    if (run.range.begin < covered) {
      // Runs are sorted and tile [0, covered): the element lies in the last run taken.
      return Status::InvalidArgument(
          "tiling of shape " + ShapeString(shape) + ": " + element(run.range.begin) +
          " is held twice, by regions " + std::to_string(last->region) + " (" +
          regions[last->region].ToString() + ") and " + std::to_string(run.region) + " (" +
          regions[run.region].ToString() + ")");
    }
    covered = run.range.end;
    last = &run;
  }
  if (covered < numel) {
    return Status::InvalidArgument("tiling of shape " + ShapeString(shape) + ": " +
                                   element(covered) + " is held by no region");
  }
  return Status::Ok();
}

}  // namespace ucp
