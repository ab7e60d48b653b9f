// The reshard planner: which bytes of which source files make up a wanted region of an atom.
//
// The planner decides; it reads nothing. Its answer is a list of Segments: the wanted region's
// bytes, in the region's storage order (region.h), as byte runs of the index's files or runs of
// zeros (padding a framework wants that no atom holds). Executing the list (executor.h) is a
// sequence of ranged reads; no segment ever needs a whole file or a whole atom in memory.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "core/format/atom_index.h"
#include "core/layout/region.h"
#include "core/util/status.h"

namespace ucp {

// A run of output bytes: `length` bytes at `offset` of source file `file` (an index into
// AtomIndex::files()), or `length` zero bytes when file == kZeroFill. With `widen_bf16` the source
// holds bfloat16 and the output its float32 values (ByteRun::widen_bf16): `length` output bytes
// from the length / 2 source bytes at `offset`.
struct Segment {
  static constexpr uint32_t kZeroFill = std::numeric_limits<uint32_t>::max();

  uint32_t file = kZeroFill;
  uint64_t offset = 0;
  uint64_t length = 0;
  bool widen_bf16 = false;

  bool zero_fill() const { return file == kZeroFill; }
  // The source bytes the segment reads.
  uint64_t source_length() const { return widen_bf16 ? length / 2 : length; }
  bool operator==(const Segment&) const = default;
};

// The bytes of `region` of `atom` (an atom of `index`), as segments in the region's storage
// order; adjacent segments contiguous in the same file are merged. kInvalidArgument when the
// region is of another shape; kFailedPrecondition when a fragment's dtype differs from the atom's
// (conversion is not a copy); kNotFound when some element is held by no fragment (cannot happen
// for a validated index, kept as a guard).
[[nodiscard]] Result<std::vector<Segment>> PlanRegion(const AtomIndex& index, const Atom& atom,
                                                      const Region& region);

// Appends `length` zero bytes to `segments` (merging with a trailing zero run).
void AppendZeros(std::vector<Segment>& segments, uint64_t length);
// Appends `more` to `segments`, merging the seam when contiguous.
void AppendSegments(std::vector<Segment>& segments, std::span<const Segment> more);
// Total bytes of `segments`.
uint64_t SegmentBytes(std::span<const Segment> segments);

}  // namespace ucp
