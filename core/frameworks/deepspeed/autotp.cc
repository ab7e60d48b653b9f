#include "core/frameworks/deepspeed/autotp.h"

#include <algorithm>
#include <cctype>
#include <functional>
#include <numeric>
#include <optional>
#include <regex>
#include <set>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "core/frameworks/deepspeed/common.h"
#include "core/io/file.h"
#include "core/util/checked.h"

namespace ucp::deepspeed {
namespace {

using pickle::Kind;
using pickle::Value;

const std::string kAffine = std::string(kUniversalCheckpointInfo) + "/affine_map";
constexpr int64_t kAffineVersion = 1;

// AutoTPMeta.from_model_config's names of the key/value head count, in its probe order. A
// transformers config reads num_attention_heads through its attribute_map where the file keeps
// the model's own name for it (GPT-2 and BLOOM: n_head; GPT-Neo: num_heads).
constexpr std::string_view kKvHeadKeys[] = {"num_key_value_heads",
                                            "num_kv_heads",
                                            "multi_query_group_num",
                                            "n_head_kv",
                                            "kv_n_heads",
                                            "num_attention_heads",
                                            "n_head",
                                            "num_heads",
                                            "n_heads",
                                            "attention_heads"};
// A config.json is a few kB; anything far larger is not one.
constexpr uint64_t kMaxModelConfigBytes = 16u << 20;

std::string BlocksText(const std::vector<uint64_t>& blocks) {
  std::string out;
  for (const uint64_t block : blocks) out += (out.empty() ? "" : ", ") + std::to_string(block);
  return "[" + out + "]";
}

// A list or tuple of ints, or nullopt.
std::optional<std::vector<int64_t>> Ints(const Value* node) {
  if (node == nullptr || (node->kind() != Kind::kList && node->kind() != Kind::kTuple)) {
    return std::nullopt;
  }
  std::vector<int64_t> out;
  for (const Value* item : node->items()) {
    if (item->kind() != Kind::kInt || !item->AsInt64()) return std::nullopt;
    out.push_back(*item->AsInt64());
  }
  return out;
}

// The name a pattern "^<escaped name>$" matches alone (re.escape's escapes undone), or nullopt
// when the pattern is not of that form.
std::optional<std::string> LiteralName(const std::string& pattern) {
  if (pattern.size() < 2 || pattern.front() != '^' || pattern.back() != '$') return std::nullopt;
  std::string name;
  for (size_t i = 1; i + 1 < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\') {
      if (i + 2 >= pattern.size()) return std::nullopt;
      const char escaped = pattern[++i];
      if (std::isalnum(static_cast<unsigned char>(escaped))) return std::nullopt;  // \d, \w, ...
      name += escaped;
    } else if (std::string_view(".^$*+?()[]{}|").find(c) != std::string_view::npos) {
      return std::nullopt;
    } else {
      name += c;
    }
  }
  return name;
}

// Patterns that name parameters: literal ones by name, the others as regexes (Python's re.match:
// anchored at the start).
class PatternTable {
 public:
  Status Add(const TorchArchiveReader& reader, const std::string& field, const std::string& pattern,
             const Value* entry) {
    if (std::optional<std::string> name = LiteralName(pattern)) {
      if (!literal_.emplace(*name, Entry{pattern, entry}).second) {
        return FieldError(reader, field, "a second entry for " + *name);
      }
      return Status::Ok();
    }
    try {
      regexes_.emplace_back(std::regex(pattern, std::regex::ECMAScript), Entry{pattern, entry});
    } catch (const std::regex_error&) {
      return Status::Unsupported(Prefix(reader.path()) + field + ": pattern \"" + pattern +
                                 "\" is not a regular expression ucp can use");
    }
    return Status::Ok();
  }

  struct Entry {
    std::string pattern;
    const Value* value = nullptr;
  };

  // Every entry whose pattern matches `name`.
  std::vector<Entry> Matches(const std::string& name) const {
    std::vector<Entry> out;
    if (const auto it = literal_.find(name); it != literal_.end()) out.push_back(it->second);
    for (const auto& [regex, entry] : regexes_) {
      if (std::regex_search(name, regex, std::regex_constants::match_continuous)) {
        out.push_back(entry);
      }
    }
    return out;
  }

 private:
  std::unordered_map<std::string, Entry> literal_;
  std::vector<std::pair<std::regex, Entry>> regexes_;
};

Shape ContiguousStrides(const Shape& shape) {
  Shape strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

Shape AsShape(const std::vector<int64_t>& values) {
  Shape out;
  for (const int64_t v : values) out.push_back(static_cast<uint64_t>(v));
  return out;
}

bool NonNegative(const std::vector<int64_t>& values) {
  for (const int64_t v : values) {
    if (v < 0) return false;
  }
  return true;
}

// One piece of a TP rank's slice: its shape, its source view [offset, strides] of the contiguous
// whole parameter, its dest view of the contiguous slice, and the ranks holding it.
struct Piece {
  Shape shape;
  int64_t source_offset = 0;
  Shape source_strides;
  int64_t dest_offset = 0;
  Shape dest_strides;
  std::vector<int64_t> locations;
};

// A TP rank's slice: its shape and its pieces, in order.
struct RankSlice {
  Shape shard;
  std::vector<Piece> pieces;
};

Result<RankSlice> ReadRankSlice(const TorchArchiveReader& reader, const std::string& field,
                                const Value* rank) {
  const auto corrupt = [&](const std::string& member, const std::string& what) {
    return FieldError(reader, field + "/" + member, what);
  };
  const std::optional<std::vector<int64_t>> shard = Ints(rank->Get("shard_shape"));
  if (!shard || !NonNegative(*shard)) return corrupt("shard_shape", "not a list of sizes");
  const Value* pieces = rank->Get("pieces");
  if (pieces == nullptr || pieces->kind() != Kind::kList || pieces->items().empty()) {
    return corrupt("pieces", "not a list of pieces");
  }
  RankSlice out;
  out.shard = AsShape(*shard);
  for (size_t i = 0; i < pieces->items().size(); ++i) {
    const Value* piece = pieces->items()[i];
    const std::string at = "pieces/" + std::to_string(i);
    if (piece->kind() != Kind::kDict) return corrupt(at, "not a dict");
    Piece read;
    const std::optional<std::vector<int64_t>> shape = Ints(piece->Get("shape"));
    if (!shape || !NonNegative(*shape)) return corrupt(at + "/shape", "not a list of sizes");
    read.shape = AsShape(*shape);
    for (const auto& [member, offset, strides] :
         {std::tuple{"source", &read.source_offset, &read.source_strides},
          std::tuple{"dest", &read.dest_offset, &read.dest_strides}}) {
      const Value* view = piece->Get(member);
      const std::string view_at = at + "/" + member;
      if (view == nullptr || (view->kind() != Kind::kList && view->kind() != Kind::kTuple) ||
          view->items().size() != 2 || view->items()[0]->kind() != Kind::kInt ||
          !view->items()[0]->AsInt64()) {
        return corrupt(view_at, "not [offset, strides]");
      }
      const std::optional<std::vector<int64_t>> view_strides = Ints(view->items()[1]);
      if (!view_strides || !NonNegative(*view_strides))
        return corrupt(view_at, "strides not sizes");
      *offset = *view->items()[0]->AsInt64();
      *strides = AsShape(*view_strides);
    }
    const std::optional<std::vector<int64_t>> locations = Ints(piece->Get("locations"));
    if (!locations) return corrupt(at + "/locations", "not a list of ranks");
    read.locations = *locations;
    if (const Value* scale = piece->Get("scale");
        scale != nullptr && !(scale->kind() == Kind::kFloat && scale->float_value() == 1.0) &&
        !(scale->kind() == Kind::kInt && scale->AsInt64() == 1)) {
      return Status::Unsupported(Prefix(reader.path()) + field + "/" + at +
                                 "/scale: a scaled slice; ucp reads unscaled ones");
    }
    out.pieces.push_back(std::move(read));
  }
  return out;
}

// Why a TP rank's slice is not of a layout ucp reads: kUnsupported naming the rank's field.
using LayoutRefusal = std::function<Status(uint32_t t, const std::string& what)>;

// Checks that every rank of `slices` holds the whole parameter of shape `whole` at offset 0.
Status CheckReplicated(const std::vector<RankSlice>& slices, const Shape& whole,
                       const LayoutRefusal& refuse) {
  const Shape strides = ContiguousStrides(whole);
  std::vector<int64_t> all(slices.size());
  for (size_t r = 0; r < slices.size(); ++r) all[r] = static_cast<int64_t>(r);
  for (uint32_t t = 0; t < slices.size(); ++t) {
    const RankSlice& slice = slices[t];
    const Piece& piece = slice.pieces[0];
    if (slice.shard != whole || slice.pieces.size() != 1 || piece.shape != whole ||
        piece.source_offset != 0 || piece.source_strides != strides || piece.dest_offset != 0 ||
        piece.dest_strides != strides || piece.locations != all) {
      return refuse(t,
                    "not the whole parameter held by every rank at offset 0, as rank 0's "
                    "slice is");
    }
  }
  return Status::Ok();
}

// The extents along dimension d of each part's blocks (rank 0's pieces the parts), [part][rank],
// where every rank's slice of the parameter of shape `whole` is its pieces one after another along
// d, each a block of the whole parameter held by that rank alone. The pieces' sources are checked
// by CheckSourceOffsets.
Result<std::vector<std::vector<uint64_t>>> PartWidths(const std::vector<RankSlice>& slices,
                                                      const Shape& whole, size_t d,
                                                      const LayoutRefusal& refuse) {
  const Shape whole_strides = ContiguousStrides(whole);
  const size_t parts = slices[0].pieces.size();
  std::vector<std::vector<uint64_t>> widths(parts);
  for (uint32_t t = 0; t < slices.size(); ++t) {
    const RankSlice& slice = slices[t];
    Shape beside = slice.shard;  // the shard but along d
    beside[d] = whole[d];
    if (slice.pieces.size() != parts || beside != whole) {
      return refuse(t, "another layout than rank 0's");
    }
    const Shape dest_strides = ContiguousStrides(slice.shard);
    uint64_t dest_at = 0;
    for (size_t i = 0; i < parts; ++i) {
      const Piece& piece = slice.pieces[i];
      Shape block = slice.shard;
      block[d] = piece.shape.size() == whole.size() ? piece.shape[d] : 0;
      if (block[d] == 0 || piece.shape != block || piece.source_strides != whole_strides ||
          piece.dest_strides != dest_strides ||
          static_cast<uint64_t>(piece.dest_offset) != dest_at * dest_strides[d] ||
          piece.locations != std::vector<int64_t>{t}) {
        return refuse(t, "piece " + std::to_string(i) + " (shape " + ShapeText(piece.shape) +
                             ") is not rank " + std::to_string(t) +
                             "'s block along one dimension, after its pieces before it");
      }
      widths[i].push_back(block[d]);
      dest_at += block[d];
    }
    if (dest_at != slice.shard[d]) {
      return refuse(t, "pieces that do not make shard_shape " + ShapeText(slice.shard));
    }
  }
  return widths;
}

// Checks that piece i of rank t comes from part i (of `map`'s sub_params along map.dim) after the
// blocks of the ranks before t (`widths`, PartWidths').
Status CheckSourceOffsets(const std::vector<RankSlice>& slices, const Shape& whole,
                          const ShardMap& map, const std::vector<std::vector<uint64_t>>& widths,
                          const LayoutRefusal& refuse) {
  const uint64_t stride = ContiguousStrides(whole)[map.dim];
  for (uint32_t t = 0; t < slices.size(); ++t) {
    uint64_t before_part = 0;  // along the split dimension, the parts before i
    for (size_t i = 0; i < widths.size(); ++i) {
      uint64_t before = before_part;
      for (uint32_t s = 0; s < t; ++s) before += widths[i][s];
      if (static_cast<uint64_t>(slices[t].pieces[i].source_offset) != before * stride) {
        return refuse(t, "piece " + std::to_string(i) + " at source offset " +
                             std::to_string(slices[t].pieces[i].source_offset) + " is not rank " +
                             std::to_string(t) +
                             "'s block along one dimension, after those of the ranks before it");
      }
      before_part += map.sub_params[i];
    }
  }
  return Status::Ok();
}

// The shard map of one affine_map entry at degree tp. AutoTP writes two layouts: every rank holds
// the whole parameter (replicated), or, along one dimension d, rank t holds one block of each of
// the parameter's sub-parameters (its fused parts, one part where nothing is fused): of
// sub-parameter i, rank t's extent after those of the ranks before it, placed in the slice after
// its blocks of the sub-parameters before i (deepspeed/checkpoint/affine.py's sub_param_map; one
// part is contiguous_split_map).
Result<std::pair<ShardMap, Shape>> MapOfEntry(const TorchArchiveReader& reader,
                                              const std::string& field, const Value* entry,
                                              uint32_t tp) {
  if (entry->kind() != Kind::kDict) return FieldError(reader, field, "not a dict");
  const std::optional<std::vector<int64_t>> logical = Ints(entry->Get("logical_shape"));
  if (!logical || !NonNegative(*logical)) {
    return FieldError(reader, field + "/logical_shape", "not a list of sizes");
  }
  const Shape whole = AsShape(*logical);
  const Value* ranks = entry->Get("ranks");
  if (ranks == nullptr || ranks->kind() != Kind::kDict || ranks->entries().size() != tp) {
    return FieldError(reader, field + "/ranks",
                      "not a dict of the " + std::to_string(tp) + " TP ranks");
  }
  std::vector<const Value*> by_rank(tp, nullptr);
  for (const auto& [key, value] : ranks->entries()) {
    const std::optional<int64_t> t = key->kind() == Kind::kInt ? key->AsInt64() : std::nullopt;
    if (!t || *t < 0 || *t >= tp || by_rank[*t] != nullptr || value->kind() != Kind::kDict) {
      return FieldError(reader, field + "/ranks",
                        "not a dict of the TP ranks 0.." + std::to_string(tp - 1) + " to dicts");
    }
    by_rank[*t] = value;
  }
  std::vector<RankSlice> slices;
  for (uint32_t t = 0; t < tp; ++t) {
    UCP_ASSIGN_OR_RETURN(RankSlice slice,
                         ReadRankSlice(reader, field + "/ranks/" + std::to_string(t), by_rank[t]));
    slices.push_back(std::move(slice));
  }
  const LayoutRefusal refuse = [&](uint32_t t, const std::string& what) {
    return Status::Unsupported(Prefix(reader.path()) + field + "/ranks/" + std::to_string(t) +
                               ": " + what +
                               "; ucp reads replicated slices and blocks along one dimension");
  };
  std::vector<size_t> cut;
  for (size_t d = 0; d < whole.size() && slices[0].shard.size() == whole.size(); ++d) {
    if (slices[0].shard[d] != whole[d]) cut.push_back(d);
  }
  if (slices[0].shard.size() != whole.size() || cut.size() > 1) {
    return refuse(0, "shard_shape " + ShapeText(slices[0].shard) + " of logical_shape " +
                         ShapeText(whole) + " is cut along more than one dimension");
  }
  if (cut.empty()) {
    UCP_RETURN_IF_ERROR(CheckReplicated(slices, whole, refuse));
    return std::pair{ShardMap{}, whole};
  }
  UCP_ASSIGN_OR_RETURN(const std::vector<std::vector<uint64_t>> widths,
                       PartWidths(slices, whole, cut.front(), refuse));
  ShardMap map;
  map.rule = Rule::kSplit;
  map.dim = static_cast<uint32_t>(cut.front());
  std::vector<uint64_t> blocks;  // as ShardMap::blocks
  for (const std::vector<uint64_t>& part : widths) {
    map.sub_params.push_back(std::accumulate(part.begin(), part.end(), uint64_t{0}));
    blocks.insert(blocks.end(), part.begin(), part.end());
  }
  if (std::accumulate(map.sub_params.begin(), map.sub_params.end(), uint64_t{0}) !=
      whole[map.dim]) {
    return Status::Unsupported(Prefix(reader.path()) + field + "/ranks: blocks " +
                               ShapeText(widths.size() == 1 ? widths[0] : map.sub_params) +
                               " do not make dim " + std::to_string(map.dim) +
                               " of logical_shape " + ShapeText(whole));
  }
  UCP_RETURN_IF_ERROR(CheckSourceOffsets(slices, whole, map, widths, refuse));
  SetBlocks(map, std::move(blocks));
  return std::pair{map, whole};
}

// The sizes along dimension `cut` of the sub-parameters of an affine_map entry whose `ranks` split
// a parameter of shape `whole` there: the sums of the ranks' pieces, one size per piece of a
// rank; one sub-parameter where the ranks' slices have no pieces or one each (AutoEP's entries
// of a size-1 expert dimension have none).
Result<std::vector<uint64_t>> SubParamSizes(const Value* ranks, const Shape& whole, size_t cut,
                                            const std::string& where, const std::string& field) {
  std::vector<uint64_t> sizes;
  for (const auto& [rank, slice] : ranks->entries()) {
    const Value* pieces = slice->kind() == Kind::kDict ? slice->Get("pieces") : nullptr;
    if (pieces == nullptr || pieces->kind() != Kind::kList || pieces->items().size() <= 1) {
      return std::vector<uint64_t>{whole[cut]};
    }
    if (sizes.empty()) sizes.assign(pieces->items().size(), 0);
    if (pieces->items().size() != sizes.size()) {
      return Status::Corrupt(Prefix(where) + field + "/ranks: slices of unlike numbers of pieces");
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      const Value* piece = pieces->items()[i];
      const std::optional<std::vector<int64_t>> shape =
          piece->kind() == Kind::kDict ? Ints(piece->Get("shape")) : std::nullopt;
      if (!shape || shape->size() != whole.size() || (*shape)[cut] < 0) {
        return Status::Corrupt(Prefix(where) + field + "/ranks: a piece without its shape");
      }
      sizes[i] += static_cast<uint64_t>((*shape)[cut]);
    }
  }
  if (std::accumulate(sizes.begin(), sizes.end(), uint64_t{0}) != whole[cut]) {
    return Status::Corrupt(Prefix(where) + field + ": pieces that do not make logical_shape " +
                           ShapeText(whole));
  }
  return sizes;
}

// Sub-parameter `part` of `parts` (`size` along the split dimension) at TP degree tp: its extents
// in `given` (as ShardMap::blocks) where that holds every part's, else tp equal ones; nullopt where
// those do not make `size`.
std::optional<std::vector<uint64_t>> PartExtents(const std::vector<uint64_t>* given, size_t part,
                                                 size_t parts, uint64_t size, uint32_t tp) {
  std::vector<uint64_t> extents;
  if (given != nullptr && given->size() == parts * tp) {
    extents.assign(given->begin() + static_cast<ptrdiff_t>(part * tp),
                   given->begin() + static_cast<ptrdiff_t>((part + 1) * tp));
  } else if (size % tp == 0) {
    extents.assign(tp, size / tp);
  }
  if (extents.size() != tp ||
      std::accumulate(extents.begin(), extents.end(), uint64_t{0}) != size) {
    return std::nullopt;
  }
  return extents;
}

// universal_checkpoint_info's sub_param_shard_widths ({pattern: [[each rank's extent] for each
// sub-parameter]}, AutoTP's record of its fused parameters) at TP degree `tp`: the blocks of
// `blocks` (as ShardMap::blocks) for the parameter a pattern names literally where it has them,
// else each sub-parameter in equal parts.
Status SetSubParamShardWidths(pickle::Graph& graph, Value* info, uint32_t tp,
                              const TorchArchiveReader& reader,
                              const std::map<std::string, std::vector<uint64_t>>& blocks) {
  const std::string field = std::string(kUniversalCheckpointInfo) + "/sub_param_shard_widths";
  Value* record = info == nullptr ? nullptr : info->Get("sub_param_shard_widths");
  if (record == nullptr) return Status::Ok();
  if (record->kind() != Kind::kDict) return FieldError(reader, field, "not a dict");
  for (auto& [pattern, parts] : record->mutable_entries()) {
    const std::string at = field + "/" + (pattern->kind() == Kind::kStr ? pattern->data() : "");
    if (parts->kind() != Kind::kList && parts->kind() != Kind::kTuple) {
      return FieldError(reader, at, "not a list of each sub-parameter's widths");
    }
    const std::optional<std::string> name =
        pattern->kind() == Kind::kStr ? LiteralName(pattern->data()) : std::nullopt;
    const auto given = name ? blocks.find(*name) : blocks.end();
    const size_t count = parts->items().size();
    std::vector<Value*> rewritten;
    for (size_t i = 0; i < count; ++i) {
      const std::optional<std::vector<int64_t>> extents = Ints(parts->items()[i]);
      if (!extents || !NonNegative(*extents)) return FieldError(reader, at, "not lists of sizes");
      const uint64_t size = std::accumulate(extents->begin(), extents->end(), uint64_t{0});
      const std::optional<std::vector<uint64_t>> at_tp =
          PartExtents(given == blocks.end() ? nullptr : &given->second, i, count, size, tp);
      if (!at_tp) {
        return Status::Unsupported(Prefix(reader.path()) + at + ": a sub-parameter of " +
                                   std::to_string(size) + " does not split evenly over tp=" +
                                   std::to_string(tp) + ", nor by blocks given for it");
      }
      rewritten.push_back(IntList(graph, *at_tp));
    }
    parts = graph.List(std::move(rewritten));
  }
  return Status::Ok();
}

// An affine_map entry's "ranks" at TP degree tp as AutoTP writes them: every rank holding the
// whole parameter of shape `whole` where `cut` is none (replicated_map), else rank t's slice
// holding, part after part, extents[i][t] along the cut of each part i (of `sub_params`' sizes),
// after the blocks of the ranks before it in that part (sub_param_map; one part:
// contiguous_split_map).
Value* RanksAtDegree(pickle::Graph& graph, const Shape& whole, std::optional<size_t> cut,
                     const std::vector<uint64_t>& sub_params,
                     const std::vector<std::vector<uint64_t>>& extents, uint32_t tp) {
  const Shape strides = ContiguousStrides(whole);
  const auto view = [&](uint64_t at, const Shape& view_strides) {
    return graph.List({graph.Int(static_cast<int64_t>(at)), IntList(graph, view_strides)});
  };
  std::vector<std::pair<Value*, Value*>> ranks;
  for (uint32_t t = 0; t < tp; ++t) {
    Shape slice = whole;
    std::vector<std::tuple<Shape, uint64_t, uint64_t>> pieces;  // shape, source, dest offsets
    Shape holders;
    if (cut) {
      slice[*cut] = 0;
      for (const std::vector<uint64_t>& part : extents) slice[*cut] += part[t];
      const Shape slice_strides = ContiguousStrides(slice);
      uint64_t before_part = 0;  // along the cut, the sub-parameters before this one
      uint64_t dest_at = 0;
      for (size_t i = 0; i < extents.size(); ++i) {
        uint64_t before = before_part;  // and rank t's blocks before
        for (uint32_t r = 0; r < t; ++r) before += extents[i][r];
        Shape block = slice;
        block[*cut] = extents[i][t];
        pieces.emplace_back(block, before * strides[*cut], dest_at * slice_strides[*cut]);
        dest_at += extents[i][t];
        before_part += sub_params[i];
      }
      holders = {t};
    } else {
      pieces.emplace_back(whole, 0, 0);
      for (uint32_t r = 0; r < tp; ++r) holders.push_back(r);
    }
    std::vector<Value*> written;
    for (const auto& [shape, source, dest] : pieces) {
      written.push_back(graph.Dict({{graph.Str("shape"), IntList(graph, shape)},
                                    {graph.Str("source"), view(source, strides)},
                                    {graph.Str("dest"), view(dest, ContiguousStrides(slice))},
                                    {graph.Str("locations"), IntList(graph, holders)}}));
    }
    ranks.emplace_back(graph.Int(t),
                       graph.Dict({{graph.Str("shard_shape"), IntList(graph, slice)},
                                   {graph.Str("pieces"), graph.List(std::move(written))}}));
  }
  return graph.Dict(std::move(ranks));
}

}  // namespace

Status SetAffineMapDegree(pickle::Graph& graph, Value* params, uint32_t tp,
                          const std::string& where,
                          const std::map<std::string, std::vector<uint64_t>>& blocks,
                          std::optional<size_t> split_dim) {
  if (params == nullptr || params->kind() != Kind::kDict) {
    return Status::Corrupt(Prefix(where) + kAffine + "/params: not a dict");
  }
  for (auto& [key, entry] : params->mutable_entries()) {
    const std::string field = kAffine + "/params/" + (key->kind() == Kind::kStr ? key->data() : "");
    const std::optional<std::vector<int64_t>> logical =
        entry->kind() == Kind::kDict ? Ints(entry->Get("logical_shape")) : std::nullopt;
    const Value* ranks = entry->kind() == Kind::kDict ? entry->Get("ranks") : nullptr;
    const Value* first = nullptr;
    if (ranks != nullptr && ranks->kind() == Kind::kDict) {
      for (const auto& [rank, value] : ranks->entries()) {
        if (rank->kind() == Kind::kInt && rank->AsInt64() == 0) first = value;
      }
    }
    const std::optional<std::vector<int64_t>> shard =
        first != nullptr && first->kind() == Kind::kDict ? Ints(first->Get("shard_shape"))
                                                         : std::nullopt;
    if (!logical || !shard || !NonNegative(*logical) || shard->size() != logical->size()) {
      return Status::Corrupt(Prefix(where) + field + ": no logical_shape or rank 0's shard_shape");
    }
    const Shape whole = AsShape(*logical);
    std::optional<size_t> cut = split_dim;
    for (size_t d = 0; d < whole.size() && !split_dim; ++d) {
      if (static_cast<uint64_t>((*shard)[d]) != whole[d]) cut = d;
    }
    if (cut && *cut >= whole.size()) {
      return Status::Corrupt(Prefix(where) + field + ": logical_shape " + ShapeText(whole) +
                             " has no dim " + std::to_string(*cut));
    }
    // Split: each sub-parameter's size along the cut, and each rank's extent of each.
    std::vector<uint64_t> sub_params;
    std::vector<std::vector<uint64_t>> extents;  // [sub-parameter][rank]
    if (cut) {
      UCP_ASSIGN_OR_RETURN(sub_params, SubParamSizes(ranks, whole, *cut, where, field));
      const std::optional<std::string> name =
          key->kind() == Kind::kStr ? LiteralName(key->data()) : std::nullopt;
      const auto given = name ? blocks.find(*name) : blocks.end();
      for (size_t i = 0; i < sub_params.size(); ++i) {
        std::optional<std::vector<uint64_t>> part =
            PartExtents(given == blocks.end() ? nullptr : &given->second, i, sub_params.size(),
                        sub_params[i], tp);
        if (!part) {
          return Status::Unsupported(
              Prefix(where) + field + ": logical_shape " + ShapeText(whole) +
              (sub_params.size() == 1
                   ? ""
                   : ", a sub-parameter of " + std::to_string(sub_params[i]) + ",") +
              " does not split evenly over tp=" + std::to_string(tp) + " along dim " +
              std::to_string(*cut) + ", nor by blocks given for it");
        }
        extents.push_back(std::move(*part));
      }
    }
    Value* new_ranks = RanksAtDegree(graph, whole, cut, sub_params, extents, tp);
    for (auto& [member, value] : entry->mutable_entries()) {
      if (member->kind() == Kind::kStr && member->data() == "ranks") {
        value = new_ranks;
      }
    }
  }
  return Status::Ok();
}

Status SetAutoTpSize(pickle::Graph& graph, Value* root, uint32_t tp,
                     const TorchArchiveReader& reader) {
  return SetConfigValue(graph, root, "tensor_parallel", "autotp_size", tp, reader);
}

Status SetTpDegree(pickle::Graph& graph, Value* root, uint32_t tp, const TorchArchiveReader& reader,
                   const std::map<std::string, std::vector<uint64_t>>& uneven) {
  UCP_RETURN_IF_ERROR(SetDictItem(root, "mp_world_size", graph.Int(tp), reader.path()));
  if (Value* dimensions = root->Get("checkpoint_parallel_dimensions");
      dimensions != nullptr && dimensions->kind() == Kind::kDict) {
    UCP_RETURN_IF_ERROR(SetDictItem(dimensions, "tp_degree", graph.Int(tp), reader.path()));
  }
  UCP_RETURN_IF_ERROR(SetAutoTpSize(graph, root, tp, reader));
  if (tp == 1) {
    std::erase_if(root->mutable_entries(), [](const std::pair<Value*, Value*>& entry) {
      return entry.first->kind() == Kind::kStr && entry.first->data() == kUniversalCheckpointInfo;
    });
    return Status::Ok();
  }
  Value* info = root->Get(kUniversalCheckpointInfo);
  Value* affine = info == nullptr ? nullptr : info->Get("affine_map");
  UCP_RETURN_IF_ERROR(SetAffineMapDegree(graph, affine == nullptr ? nullptr : affine->Get("params"),
                                         tp, reader.path(), uneven));
  return SetSubParamShardWidths(graph, info, tp, reader, uneven);
}

bool HasAutoTpMaps(const TorchArchiveReader& reader) {
  return OptionalField(reader, kAffine + "/params") != nullptr;
}

Result<AutoTpMaps> ReadAutoTpMaps(const TorchArchiveReader& reader, uint32_t tp,
                                  const std::vector<std::string>& names) {
  const std::string info(kUniversalCheckpointInfo);
  if (const Value* unsupported =
          OptionalField(reader, info + "/autotp_unsupported_parameter_patterns");
      unsupported != nullptr && !NamedChildren(unsupported).empty()) {
    return Status::Unsupported(
        Prefix(reader.path()) + info +
        "/autotp_unsupported_parameter_patterns: AutoTP could not describe " +
        NamedChildren(unsupported).front().first + " and others");
  }
  UCP_ASSIGN_OR_RETURN(const int64_t version, IntField(reader, kAffine + "/version"));
  if (version != kAffineVersion) {
    return Status::Unsupported(Prefix(reader.path()) + kAffine +
                               "/version: " + std::to_string(version) + "; ucp reads version 1");
  }
  UCP_ASSIGN_OR_RETURN(const Value* params, Field(reader, kAffine + "/params"));
  if (params->kind() != Kind::kDict) {
    return FieldError(reader, kAffine + "/params", "not a dict");
  }
  PatternTable table;
  for (const auto& [key, entry] : params->entries()) {
    if (key->kind() != Kind::kStr)
      return FieldError(reader, kAffine + "/params", "a key not a str");
    UCP_RETURN_IF_ERROR(table.Add(reader, kAffine + "/params/" + key->data(), key->data(), entry));
  }
  PatternTable vocabulary;
  if (const Value* patterns = OptionalField(reader, info + "/vocabulary_parameter_patterns")) {
    const std::string field = info + "/vocabulary_parameter_patterns";
    if (patterns->kind() != Kind::kList) return FieldError(reader, field, "not a list");
    for (const Value* pattern : patterns->items()) {
      if (pattern->kind() != Kind::kStr) return FieldError(reader, field, "a pattern not a str");
      UCP_RETURN_IF_ERROR(vocabulary.Add(reader, field, pattern->data(), pattern));
    }
  }
  const Value* original_vocab = OptionalField(reader, info + "/original_vocab_size");

  AutoTpMaps out;
  for (const std::string& name : names) {
    const std::vector<PatternTable::Entry> entries = table.Matches(name);
    if (entries.size() != 1) {
      return Status::Unsupported(Prefix(reader.path()) + kAffine +
                                 "/params: " + std::to_string(entries.size()) +
                                 " entries describe " + name + ", so its TP layout is not known");
    }
    UCP_ASSIGN_OR_RETURN(auto map_and_shape,
                         MapOfEntry(reader, kAffine + "/params/" + entries.front().pattern,
                                    entries.front().value, tp));
    if (!vocabulary.Matches(name).empty()) {
      // ds_to_universal keeps the first original_vocab_size rows of a vocabulary parameter.
      if (original_vocab != nullptr &&
          (original_vocab->kind() != Kind::kInt || map_and_shape.second.empty() ||
           original_vocab->AsInt64() != static_cast<int64_t>(map_and_shape.second[0]))) {
        return Status::Unsupported(Prefix(reader.path()) + info + "/original_vocab_size: not the " +
                                   "rows of " + name + " (" + ShapeText(map_and_shape.second) +
                                   "); ucp reads unpadded vocabularies");
      }
      out.vocabulary.insert(name);
    }
    out.maps.emplace(name, std::move(map_and_shape.first));
    out.whole_shapes.emplace(name, std::move(map_and_shape.second));
  }
  return out;
}

std::vector<uint64_t> GrainBlocks(uint64_t total, uint32_t tp, uint64_t grain) {
  std::vector<uint64_t> blocks(tp);
  if (tp == 0 || grain == 0) return blocks;
  if (total < grain) {
    for (uint32_t t = 0; t < tp; ++t) blocks[t] = total / tp + (t < total % tp ? 1 : 0);
    return blocks;
  }
  const uint64_t units = total / grain;
  for (uint32_t t = 0; t < tp; ++t) blocks[t] = (units / tp + (t < units % tp ? 1 : 0)) * grain;
  blocks[tp - 1] += total % grain;
  return blocks;
}

std::vector<uint64_t> HeadBlocks(uint64_t total, uint32_t tp, uint64_t kv_heads) {
  std::vector<uint64_t> blocks(tp);
  if (kv_heads == 0) return blocks;
  for (uint32_t t = 0; t < tp; ++t) {
    const uint64_t heads = kv_heads / tp + (t < kv_heads % tp ? 1 : 0);
    blocks[t] = total / kv_heads * heads;
  }
  return blocks;
}

Result<AutoTpSplitRule> ReadAutoTpSplitRule(const TorchArchiveReader& reader,
                                            const std::string& tag_dir) {
  AutoTpSplitRule rule;
  const std::string grain_field = "ds_config/tensor_parallel/tp_grain_size";
  if (const Value* grain = OptionalField(reader, grain_field)) {
    const std::optional<int64_t> value =
        grain->kind() == Kind::kInt ? grain->AsInt64() : std::nullopt;
    if (!value || *value < 1) return FieldError(reader, grain_field, "not a positive int");
    rule.grain = static_cast<uint64_t>(*value);
  }
  std::string folder = tag_dir;
  while (folder.size() > 1 && folder.back() == '/') folder.pop_back();
  const size_t slash = folder.rfind('/');
  folder = slash == std::string::npos ? "." : slash == 0 ? "/" : folder.substr(0, slash);
  const std::string path = folder + "/config.json";
  Result<std::string> text = ReadSmallFile(path, kMaxModelConfigBytes);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) return rule;
    return text.status();
  }
  rule.model_config = true;
  const nlohmann::json config = nlohmann::json::parse(*text, nullptr, false);
  if (!config.is_object()) return Status::Corrupt(Prefix(path) + "not a JSON object");
  const bool nested = config.contains("text_config") && config["text_config"].is_object();
  const nlohmann::json& text_config = nested ? config["text_config"] : config;
  for (const std::string_view key : kKvHeadKeys) {
    const auto found = text_config.find(std::string(key));
    if (found == text_config.end() || found->is_null()) continue;
    const std::string field = (nested ? "text_config/" : "") + std::string(key);
    if (!found->is_number_unsigned() || found->get<uint64_t>() == 0) {
      return Status::Corrupt(Prefix(path) + field + ": not a positive int");
    }
    rule.kv_heads = found->get<uint64_t>();
    rule.kv_heads_from = path + ": " + field;
    break;
  }
  return rule;
}

Result<std::vector<uint64_t>> BlocksAtDegree(const std::string& name, uint64_t total,
                                             const std::vector<uint64_t>& saved, uint32_t to,
                                             const AutoTpSplitRule& rule) {
  const uint32_t from = static_cast<uint32_t>(saved.size());
  const std::string grain = "tp_grain_size " + std::to_string(rule.grain);
  const auto refuse = [&](const std::string& why) {
    return Status::Unsupported("deepspeed: tp=" + std::to_string(to) + ": " + name + " (" +
                               std::to_string(total) + " along its split dimension): " + why);
  };
  if (rule.model_config && !rule.kv_heads) {
    return refuse(
        "the config.json beside the tag names no key/value head count, so how AutoTP splits an "
        "attention layer at another degree is not known");
  }
  const bool can_take_heads = rule.kv_heads && total % *rule.kv_heads == 0;
  const std::string heads = can_take_heads ? std::to_string(*rule.kv_heads) + " key/value heads (" +
                                                 rule.kv_heads_from + ")"
                                           : "";
  // The saved blocks say which way the layer went where the two ways differ at `from`.
  const bool took_grain = GrainBlocks(total, from, rule.grain) == saved;
  const bool took_heads = can_take_heads && HeadBlocks(total, from, *rule.kv_heads) == saved;
  if (!took_grain && !took_heads) {
    return refuse("AutoTP split it at tp=" + std::to_string(from) + " into blocks of " +
                  BlocksText(saved) + ", which " + grain + (can_take_heads ? " and " + heads : "") +
                  " do not give; the split rule ucp read is not the one the model ran with (a "
                  "model with a Hugging Face config needs its config.json beside the tag)");
  }
  const std::vector<uint64_t> by_grain = GrainBlocks(total, to, rule.grain);
  const std::vector<uint64_t> by_heads =
      can_take_heads ? HeadBlocks(total, to, *rule.kv_heads) : by_grain;
  if (took_grain && took_heads && by_grain != by_heads) {
    return refuse("AutoTP splits it into blocks of " + BlocksText(by_grain) + " (" + grain +
                  ") or, if it is an attention layer, of " + BlocksText(by_heads) + " (" + heads +
                  "), and the checkpoint does not say which it is");
  }
  const std::vector<uint64_t>& blocks = took_grain ? by_grain : by_heads;
  if (std::find(blocks.begin(), blocks.end(), 0) != blocks.end()) {
    return refuse("AutoTP splits it into blocks of " + BlocksText(blocks) + " (" +
                  (took_grain ? grain : heads) + "); ucp writes no empty slices");
  }
  return blocks;
}

Result<std::vector<uint64_t>> MapBlocksAtDegree(const std::string& name, const Geometry& saved,
                                                uint32_t to, const AutoTpSplitRule& rule) {
  std::vector<uint64_t> blocks;
  const size_t parts = saved.sub_params.size();
  for (size_t i = 0; i < parts; ++i) {
    UCP_ASSIGN_OR_RETURN(
        const std::vector<uint64_t> part,
        BlocksAtDegree(parts == 1 ? name : name + " (sub-parameter " + std::to_string(i) + ")",
                       saved.sub_params[i], SplitBlocks(saved, i), to, rule));
    blocks.insert(blocks.end(), part.begin(), part.end());
  }
  return blocks;
}

Status MapsAtDegree(const AtomIndex& index, uint32_t from, uint32_t to, const AutoTpSplitRule& rule,
                    std::map<std::string, ShardMap>& maps) {
  for (auto& [name, map] : maps) {
    if (map.rule != Rule::kSplit) continue;
    const Atom* atom = index.Find(name, "bit16");  // every parameter's, frozen ones' too
    if (atom == nullptr) return Status::Corrupt("deepspeed: index: no bit16 atom of " + name);
    UCP_ASSIGN_OR_RETURN(const Geometry saved,
                         GeometryAt(name, map, atom->shape, from, std::nullopt, map.blocks));
    UCP_ASSIGN_OR_RETURN(std::vector<uint64_t> blocks, MapBlocksAtDegree(name, saved, to, rule));
    SetBlocks(map, std::move(blocks));
  }
  return Status::Ok();
}

Status SetReplicatedShapes(pickle::Graph& graph, Value* root, const TorchArchiveReader& reader,
                           const std::map<std::string, Shape>& shapes) {
  Value* info = root->Get(kUniversalCheckpointInfo);
  Value* affine = info == nullptr ? nullptr : info->Get("affine_map");
  Value* params = affine == nullptr ? nullptr : affine->Get("params");
  if (params == nullptr || params->kind() != Kind::kDict) {
    return FieldError(reader, kAffine + "/params", "not a dict");
  }
  std::set<std::string> found;
  for (auto& [key, entry] : params->mutable_entries()) {
    const std::optional<std::string> name =
        key->kind() == Kind::kStr ? LiteralName(key->data()) : std::nullopt;
    const auto shape = name ? shapes.find(*name) : shapes.end();
    if (shape == shapes.end()) continue;
    const std::string field = kAffine + "/params/" + key->data();
    if (entry->kind() != Kind::kDict) return FieldError(reader, field, "not a dict");
    UCP_RETURN_IF_ERROR(
        SetDictItem(entry, "logical_shape", IntList(graph, shape->second), reader.path()));
    Value* whole = graph.Dict({{graph.Str("shard_shape"), IntList(graph, shape->second)}});
    UCP_RETURN_IF_ERROR(
        SetDictItem(entry, "ranks", graph.Dict({{graph.Int(0), whole}}), reader.path()));
    found.insert(*name);
  }
  for (const auto& [name, shape] : shapes) {
    if (!found.contains(name)) {
      return FieldError(reader, kAffine + "/params", "no entry names " + name);
    }
  }
  return Status::Ok();
}

}  // namespace ucp::deepspeed
