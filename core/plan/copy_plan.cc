#include "core/plan/copy_plan.h"

#include <algorithm>
#include <string>
#include <utility>

namespace ucp {
namespace {

// Appends `segment` to `segments`, extending the last one when the bytes continue it.
void Append(std::vector<Segment>& segments, const Segment& segment) {
  if (segment.length == 0) return;
  if (!segments.empty()) {
    Segment& last = segments.back();
    if (last.file == segment.file && last.widen_bf16 == segment.widen_bf16 &&
        (segment.zero_fill() || last.offset + last.source_length() == segment.offset)) {
      last.length += segment.length;
      return;
    }
  }
  segments.push_back(segment);
}

}  // namespace

Result<std::vector<Segment>> PlanRegion(const AtomIndex& index, const Atom& atom,
                                        const Region& region) {
  const std::string what = "plan " + atom.param + "/" + atom.state + " " + region.ToString();
  if (region.shape() != atom.shape) {
    return Status::InvalidArgument(what + ": the region is of another shape than the atom");
  }
  const uint64_t itemsize = ItemSize(atom.dtype);
  const FlatRange wanted = region.bounds();
  // (position in the wanted region's storage order, bytes)
  std::vector<std::pair<uint64_t, Segment>> pieces;
  for (const Fragment& fragment : atom.fragments) {
    if (fragment.dtype != atom.dtype) {
      return Status::FailedPrecondition(what + ": a fragment holds " +
                                        std::string(TorchName(fragment.dtype)) + ", the atom is " +
                                        std::string(TorchName(atom.dtype)));
    }
    if (fragment.file >= index.files().size()) {
      return Status::InvalidArgument(what + ": a fragment names file " +
                                     std::to_string(fragment.file) + ", the index has " +
                                     std::to_string(index.files().size()));
    }
    const FlatRange held = fragment.region.bounds();
    if (held.end <= wanted.begin || wanted.end <= held.begin) continue;
    UCP_ASSIGN_OR_RETURN(const std::vector<OverlapPiece> overlap, Overlap(region, fragment.region));
    for (const OverlapPiece& piece : overlap) {
      // The index validated that every fragment's bytes lie inside its file: no overflow here.
      pieces.emplace_back(piece.a_position,
                          Segment{fragment.file, fragment.offset + piece.b_position * itemsize,
                                  piece.length * itemsize});
    }
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<Segment> segments;
  uint64_t position = 0;
  for (const auto& [begin, segment] : pieces) {
    if (begin != position) {
      // A validated index tiles every atom, so neither a hole nor a double can occur.
      return Status::NotFound(what + ": element " + std::to_string(position) +
                              " of the region is " +
                              (begin > position ? "held by no fragment" : "held twice"));
    }
    Append(segments, segment);
    position += segment.length / itemsize;
  }
  if (position != region.numel()) {
    return Status::NotFound(what + ": element " + std::to_string(position) +
                            " of the region is held by no fragment");
  }
  return segments;
}

void AppendZeros(std::vector<Segment>& segments, uint64_t length) {
  Append(segments, Segment{Segment::kZeroFill, 0, length});
}

void AppendSegments(std::vector<Segment>& segments, std::span<const Segment> more) {
  for (const Segment& segment : more) Append(segments, segment);
}

uint64_t SegmentBytes(std::span<const Segment> segments) {
  uint64_t total = 0;
  for (const Segment& segment : segments) total += segment.length;
  return total;
}

}  // namespace ucp
