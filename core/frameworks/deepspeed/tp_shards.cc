#include "core/frameworks/deepspeed/tp_shards.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <utility>

#include "core/util/checked.h"

namespace ucp::deepspeed {
namespace {

// Positions [p, q) of the row-major order of box (offsets, extents), from dimension d on, as
// boxes in that order; `prefix_*` fix the dimensions before d.
void DecomposeRun(const Shape& offsets, const Shape& extents, size_t d, uint64_t p, uint64_t q,
                  Shape prefix_offsets, Shape prefix_extents,
                  std::vector<std::pair<Shape, Shape>>& out) {
  if (p >= q) return;
  if (d == extents.size()) {
    out.emplace_back(std::move(prefix_offsets), std::move(prefix_extents));
    return;
  }
  uint64_t inner = 1;
  for (size_t i = d + 1; i < extents.size(); ++i) inner *= extents[i];
  const auto box = [&](uint64_t row, uint64_t rows) {
    Shape o = prefix_offsets;
    Shape e = prefix_extents;
    o.push_back(offsets[d] + row);
    e.push_back(rows);
    for (size_t i = d + 1; i < extents.size(); ++i) {
      o.push_back(offsets[i]);
      e.push_back(extents[i]);
    }
    out.emplace_back(std::move(o), std::move(e));
  };
  const auto partial = [&](uint64_t row, uint64_t from, uint64_t to) {
    Shape o = prefix_offsets;
    Shape e = prefix_extents;
    o.push_back(offsets[d] + row);
    e.push_back(1);
    DecomposeRun(offsets, extents, d + 1, from, to, std::move(o), std::move(e), out);
  };
  uint64_t row = p / inner;
  if (p % inner != 0) {
    const uint64_t end = std::min(q, (row + 1) * inner);
    partial(row, p - row * inner, end - row * inner);
    p = end;
    ++row;
  }
  if (p >= q) return;
  const uint64_t last = q / inner;
  if (last > row) {
    box(row, last - row);
    p = last * inner;
  }
  if (p < q) partial(last, 0, q - last * inner);
}

void AppendRun(std::vector<GlobalRun>& runs, std::optional<Region> region, uint64_t count) {
  if (count == 0) return;
  if (!region && !runs.empty() && !runs.back().region) {
    runs.back().count += count;
    return;
  }
  runs.push_back({std::move(region), count});
}

}  // namespace

Result<uint64_t> PaddedVocab(const Vocab& vocab, uint32_t tp) {
  const std::optional<uint64_t> multiple = CheckedMul(vocab.divisible_by, uint64_t{tp});
  if (!multiple || *multiple == 0) {
    return Status::OutOfRange("deepspeed: vocabulary padding multiple overflows");
  }
  const std::optional<uint64_t> sum = CheckedAdd(vocab.original, *multiple - 1);
  if (!sum) return Status::OutOfRange("deepspeed: padded vocabulary size overflows");
  return *sum / *multiple * *multiple;
}

nlohmann::json MapJson(const ShardMap& map) {
  nlohmann::json out = {{"rule", RuleName(map.rule)}};
  if (map.rule != Rule::kSplit) return out;
  out["dim"] = map.dim;
  out["sub_params"] = map.sub_params;
  out["vocab"] = map.vocab;
  out["universal"] = FormName(map.universal);
  if (map.universal == UniversalForm::kSubParamShape) out["sub_param_shape"] = map.sub_param_shape;
  if (!map.blocks.empty()) out["blocks"] = map.blocks;
  return out;
}

Result<ShardMap> MapFromJson(const std::string& name, const nlohmann::json& json) {
  const Status bad = Status::Corrupt("deepspeed: index adapter_state.tp.params[\"" + name +
                                     "\"]: malformed shard map");
  if (!json.is_object() || !json.contains("rule") || !json["rule"].is_string()) return bad;
  ShardMap map;
  const std::string rule = json["rule"].get<std::string>();
  if (rule == "replicated") return map;
  if (rule == "averaged") {
    map.rule = Rule::kAveraged;
    return map;
  }
  if (rule == "unnamed") {
    map.rule = Rule::kUnnamed;
    return map;
  }
  if (rule != "split") return bad;
  map.rule = Rule::kSplit;
  if (!json.contains("dim") || !json["dim"].is_number_unsigned() || !json.contains("sub_params") ||
      !json["sub_params"].is_array() || json["sub_params"].empty() || !json.contains("vocab") ||
      !json["vocab"].is_boolean() || !json.contains("universal") ||
      !json["universal"].is_string()) {
    return bad;
  }
  map.dim = json["dim"].get<uint32_t>();
  for (const nlohmann::json& size : json["sub_params"]) {
    if (!size.is_number_unsigned()) return bad;
    map.sub_params.push_back(size.get<uint64_t>());
  }
  map.vocab = json["vocab"].get<bool>();
  const std::string form = json["universal"].get<std::string>();
  if (form == "none") {  // AutoTP's splits: ds_to_universal writes no key for them
    map.universal = UniversalForm::kNone;
  } else if (form == "cat_dim") {
    map.universal = UniversalForm::kCatDim;
  } else if (form == "n_sub_params") {
    map.universal = UniversalForm::kNSubParams;
  } else if (form == "sub_param_shape") {
    map.universal = UniversalForm::kSubParamShape;
    if (!json.contains("sub_param_shape") || !json["sub_param_shape"].is_number_unsigned()) {
      return bad;
    }
    map.sub_param_shape = json["sub_param_shape"].get<uint32_t>();
  } else {
    return bad;
  }
  if (map.vocab && (map.dim != 0 || map.sub_params.size() != 1)) return bad;
  if (const auto blocks = json.find("blocks"); blocks != json.end()) {
    const size_t parts = map.sub_params.size();
    if (!blocks->is_array() || map.vocab || parts == 0 || blocks->size() % parts != 0 ||
        blocks->size() / parts < 2) {
      return bad;
    }
    for (const nlohmann::json& block : *blocks) {
      if (!block.is_number_unsigned() || block.get<uint64_t>() == 0) return bad;
      map.blocks.push_back(block.get<uint64_t>());
    }
    const size_t tp = map.blocks.size() / parts;
    for (size_t i = 0; i < parts; ++i) {
      const auto first = map.blocks.begin() + static_cast<ptrdiff_t>(i * tp);
      if (std::accumulate(first, first + static_cast<ptrdiff_t>(tp), uint64_t{0}) !=
          map.sub_params[i]) {
        return bad;
      }
    }
  }
  return map;
}

void SetBlocks(ShardMap& map, std::vector<uint64_t> blocks) {
  const size_t parts = std::max<size_t>(map.sub_params.size(), 1);
  const size_t tp = blocks.size() / parts;
  bool equal = true;
  for (size_t i = 0; i < parts && equal; ++i) {
    const auto first = blocks.begin() + static_cast<ptrdiff_t>(i * tp);
    equal = std::adjacent_find(first, first + static_cast<ptrdiff_t>(tp), std::not_equal_to<>()) ==
            first + static_cast<ptrdiff_t>(tp);
  }
  map.blocks = equal ? std::vector<uint64_t>{} : std::move(blocks);
}

std::vector<uint64_t> SplitBlocks(const Geometry& g, size_t part) {
  if (!g.blocks.empty()) {
    const auto first = g.blocks.begin() + static_cast<ptrdiff_t>(part * g.tp);
    return {first, first + static_cast<ptrdiff_t>(g.tp)};
  }
  return std::vector<uint64_t>(g.tp, g.sub_params[part] / g.tp);
}

Geometry WholeGeometry(uint32_t tp, const Shape& shape) {
  Geometry g;
  g.tp = tp;
  g.local = shape;
  g.atom = shape;
  return g;
}

Shape LocalShape(const Geometry& g, uint32_t t) {
  if (g.blocks.empty()) return g.local;
  Shape local = g.local;
  local[g.dim] = 0;
  for (size_t i = 0; i < g.sub_params.size(); ++i) local[g.dim] += g.blocks[i * g.tp + t];
  return local;
}

Result<Geometry> GeometryAt(const std::string& name, const ShardMap& map, const Shape& atom,
                            uint32_t tp, const std::optional<Vocab>& vocab,
                            const std::vector<uint64_t>& blocks) {
  Geometry g = WholeGeometry(tp, atom);
  if (map.rule == Rule::kUnnamed && tp > 1) {
    return Status::Unsupported(
        "deepspeed: tp=" + std::to_string(tp) + ": " + name + ": no rule of " +
        std::string(kUniversalCheckpointInfo) +
        " names this parameter and the tag has one TP rank, so nothing says whether it is split "
        "(and on which dimension) or replicated; ucp does not guess: name it in the client's "
        "universal_checkpoint_info patterns");
  }
  if (map.rule != Rule::kSplit) return g;
  if (map.dim >= atom.size()) {
    return Status::Corrupt("deepspeed: " + name + ": split dimension " + std::to_string(map.dim) +
                           " of a " + std::to_string(atom.size()) + "-d parameter");
  }
  g.sub_params = map.sub_params;
  g.dim = map.dim;
  if (!blocks.empty()) {
    bool fit = !map.vocab && blocks.size() == map.sub_params.size() * tp &&
               std::find(blocks.begin(), blocks.end(), 0) == blocks.end();
    uint64_t total = 0;
    for (size_t i = 0; i < map.sub_params.size() && fit; ++i) {
      const auto first = blocks.begin() + static_cast<ptrdiff_t>(i * tp);
      fit = std::accumulate(first, first + tp, uint64_t{0}) == map.sub_params[i];
      total += map.sub_params[i];
    }
    if (!fit || total != atom[map.dim]) {
      return Status::Corrupt("deepspeed: " + name + ": TP blocks that do not split dim " +
                             std::to_string(map.dim) + " of " + std::to_string(atom[map.dim]) +
                             " over tp=" + std::to_string(tp));
    }
    g.blocks = blocks;
    g.local = LocalShape(g, 0);
    return g;
  }
  if (map.vocab) {
    if (!vocab) return Status::Corrupt("deepspeed: " + name + ": a vocabulary without its sizes");
    UCP_ASSIGN_OR_RETURN(const uint64_t padded, PaddedVocab(*vocab, tp));
    g.sub_params = {padded};
    if (atom[0] < vocab->original || atom[0] > padded) {
      return Status::Corrupt("deepspeed: " + name + ": " + std::to_string(atom[0]) +
                             " rows, but the vocabulary has " + std::to_string(vocab->original) +
                             ", padded to " + std::to_string(padded) +
                             " at tp=" + std::to_string(tp));
    }
  }
  uint64_t local = 0;
  uint64_t total = 0;
  for (const uint64_t size : g.sub_params) {
    if (size % tp != 0) {
      return Status::Unsupported("deepspeed: tp=" + std::to_string(tp) + ": " + name +
                                 ": a sub-parameter of " + std::to_string(size) + " along dim " +
                                 std::to_string(map.dim) + " does not split evenly");
    }
    local += size / tp;
    total += size;
  }
  if (!map.vocab && total != atom[map.dim]) {
    return Status::Corrupt("deepspeed: " + name + ": sub-parameters of " + std::to_string(total) +
                           " along dim " + std::to_string(map.dim) + ", but the atom has " +
                           std::to_string(atom[map.dim]));
  }
  g.local[map.dim] = local;
  return g;
}

Result<std::vector<GlobalRun>> MapLocalRange(const ShardMap& map, const Geometry& g, uint32_t t,
                                             uint64_t begin, uint64_t end) {
  std::vector<GlobalRun> runs;
  if (map.rule != Rule::kSplit) {
    UCP_ASSIGN_OR_RETURN(Region region, Region::Flat(begin, end, g.atom));
    AppendRun(runs, std::move(region), end - begin);
    return runs;
  }
  const Shape local = LocalShape(g, t);
  UCP_ASSIGN_OR_RETURN(const Region range, Region::Flat(begin, end, local));
  // Sub-parameter i is the box of the slice at [local_lo, + part) along dim, and of the padded
  // global tensor at [global_lo + t·part, + part).
  struct Hit {
    uint64_t position;  // in the range's order
    uint64_t length;
    uint64_t box_position;
    size_t block;
  };
  std::vector<Hit> hits;
  std::vector<Shape> global_offsets;
  std::vector<Shape> block_extents;
  uint64_t local_lo = 0;
  uint64_t global_lo = 0;
  for (size_t i = 0; i < g.sub_params.size(); ++i) {
    // Rank t's part of the sub-parameter and where it starts: equal parts, or the blocks'.
    uint64_t part = g.sub_params[i] / g.tp;
    uint64_t before = uint64_t{t} * part;
    if (!g.blocks.empty()) {
      part = g.blocks[i * g.tp + t];
      before = 0;
      for (uint32_t s = 0; s < t; ++s) before += g.blocks[i * g.tp + s];
    }
    Shape local_offsets(local.size(), 0);
    local_offsets[map.dim] = local_lo;
    Shape extents = local;
    extents[map.dim] = part;
    UCP_ASSIGN_OR_RETURN(const Region box, Region::Box(local_offsets, extents, local));
    UCP_ASSIGN_OR_RETURN(const std::vector<OverlapPiece> pieces, Overlap(range, box));
    for (const OverlapPiece& piece : pieces) {
      hits.push_back({piece.a_position, piece.length, piece.b_position, i});
    }
    Shape offsets(local.size(), 0);
    offsets[map.dim] = global_lo + before;
    global_offsets.push_back(std::move(offsets));
    block_extents.push_back(std::move(extents));
    local_lo += part;
    global_lo += g.sub_params[i];
  }
  std::sort(hits.begin(), hits.end(),
            [](const Hit& a, const Hit& b) { return a.position < b.position; });
  for (const Hit& hit : hits) {
    std::vector<std::pair<Shape, Shape>> boxes;
    DecomposeRun(global_offsets[hit.block], block_extents[hit.block], 0, hit.box_position,
                 hit.box_position + hit.length, {}, {}, boxes);
    for (const auto& [offsets, extents] : boxes) {
      uint64_t row = 1;  // elements per step of dimension 0
      for (size_t d = 1; d < extents.size(); ++d) row *= extents[d];
      // Vocabulary padding: rows at or past the atom's (the split dimension is 0).
      uint64_t real_rows = extents[0];
      if (map.vocab) {
        real_rows = offsets[0] >= g.atom[0] ? 0 : std::min(extents[0], g.atom[0] - offsets[0]);
      }
      if (real_rows > 0) {
        Shape real_extents = extents;
        real_extents[0] = real_rows;
        UCP_ASSIGN_OR_RETURN(Region region, Region::Box(offsets, real_extents, g.atom));
        const std::vector<FlatRange> flat = region.Runs();
        if (flat.size() == 1) {
          UCP_ASSIGN_OR_RETURN(region, Region::Flat(flat[0].begin, flat[0].end, g.atom));
        }
        AppendRun(runs, std::move(region), row * real_rows);
      }
      AppendRun(runs, std::nullopt, row * (extents[0] - real_rows));
    }
  }
  return runs;
}

Status AddSliceFragments(Atom& atom, const ShardMap& map, const Geometry& geometry, uint32_t t,
                         uint64_t begin, uint64_t end, uint32_t file, uint64_t byte, DType dtype) {
  UCP_ASSIGN_OR_RETURN(std::vector<GlobalRun> runs, MapLocalRange(map, geometry, t, begin, end));
  const uint64_t item = ItemSize(dtype);
  uint64_t position = 0;
  for (GlobalRun& run : runs) {
    if (run.region) {
      const std::optional<uint64_t> at = CheckedMul(position, item);
      const std::optional<uint64_t> offset = at ? CheckedAdd(byte, *at) : std::nullopt;
      if (!offset) {
        return Status::OutOfRange("deepspeed: " + atom.param + "/" + atom.state +
                                  ": offset overflow");
      }
      atom.fragments.push_back({file, *offset, dtype, std::move(*run.region)});
    }
    position += run.count;
  }
  return Status::Ok();
}

Status AppendSliceSegments(const AtomIndex& index, const Atom& atom, const ShardMap& map,
                           const Geometry& geometry, uint32_t t, uint64_t begin, uint64_t end,
                           std::vector<Segment>& segments) {
  UCP_ASSIGN_OR_RETURN(const std::vector<GlobalRun> runs,
                       MapLocalRange(map, geometry, t, begin, end));
  for (const GlobalRun& run : runs) {
    if (!run.region) {
      AppendZeros(segments, run.count * ItemSize(atom.dtype));
      continue;
    }
    UCP_ASSIGN_OR_RETURN(const std::vector<Segment> more, PlanRegion(index, atom, *run.region));
    AppendSegments(segments, more);
  }
  return Status::Ok();
}

Status SliceSegments(const AtomIndex& index, const ShardMap& map, const std::string& name,
                     const Geometry& geometry, uint32_t t, std::string_view state, uint64_t begin,
                     uint64_t end, std::vector<Segment>& segments) {
  const Atom* atom = index.Find(name, state);
  if (atom == nullptr) {
    return Status::Corrupt("deepspeed: index: no atom " + name + "/" + std::string(state));
  }
  return AppendSliceSegments(index, *atom, map, geometry, t, begin, end, segments);
}

Result<TargetGroup> TargetGroupAt(const AtomIndex& index,
                                  const std::map<std::string, ShardMap>& maps,
                                  const std::optional<Vocab>& vocab,
                                  const std::vector<std::string>& names, uint32_t tp, uint32_t t,
                                  uint32_t dp) {
  TargetGroup group;
  std::vector<Shape> shapes;
  for (const std::string& name : names) {
    const Atom* atom = index.Find(name, "fp32");
    const auto map = maps.find(name);
    if (atom == nullptr || map == maps.end()) {
      return Status::Corrupt("deepspeed: index: no fp32 atom or shard map of " + name);
    }
    UCP_ASSIGN_OR_RETURN(Geometry g,
                         GeometryAt(name, map->second, atom->shape, tp, vocab, map->second.blocks));
    shapes.push_back(LocalShape(g, t));
    group.geometry.push_back(std::move(g));
  }
  UCP_ASSIGN_OR_RETURN(group.layout, MakeLayout(names, std::move(shapes)));
  UCP_ASSIGN_OR_RETURN(group.partition, SavablePartition(group.layout.total, dp, "a group"));
  return group;
}

Result<std::vector<Segment>> SliceFlatSegments(const AtomIndex& index,
                                               const std::map<std::string, ShardMap>& maps,
                                               const TargetGroup& group, uint32_t t,
                                               std::string_view state, uint64_t begin,
                                               uint64_t end) {
  std::vector<Segment> segments;
  const GroupLayout& layout = group.layout;
  for (size_t k = 0; k < layout.names.size(); ++k) {
    const uint64_t off = layout.offsets[k];
    const uint64_t lo = std::max(off, begin);
    const uint64_t hi = std::min(off + layout.numels[k], end);
    if (lo >= hi) continue;
    UCP_RETURN_IF_ERROR(SliceSegments(index, maps.at(layout.names[k]), layout.names[k],
                                      group.geometry[k], t, state, lo - off, hi - off, segments));
  }
  return segments;
}

}  // namespace ucp::deepspeed
