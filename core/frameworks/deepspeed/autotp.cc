#include "core/frameworks/deepspeed/autotp.h"

#include <algorithm>
#include <cctype>
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

// The one piece of TP rank t's slice: its shape, source view [offset, strides] of the whole
// parameter, dest view of the slice, and the ranks holding it.
struct WholeRankPiece {
  Shape shard;
  Shape shape;
  int64_t source_offset = 0;
  Shape source_strides;
  int64_t dest_offset = 0;
  Shape dest_strides;
  std::vector<int64_t> locations;
};

Result<WholeRankPiece> ReadRankPiece(const TorchArchiveReader& reader, const std::string& field,
                                     const Value* rank) {
  const auto corrupt = [&](const std::string& member, const std::string& what) {
    return FieldError(reader, field + "/" + member, what);
  };
  const std::optional<std::vector<int64_t>> shard = Ints(rank->Get("shard_shape"));
  if (!shard || !NonNegative(*shard)) return corrupt("shard_shape", "not a list of sizes");
  const Value* pieces = rank->Get("pieces");
  if (pieces == nullptr || pieces->kind() != Kind::kList) {
    return corrupt("pieces", "not a list");
  }
  if (pieces->items().size() != 1) {
    return Status::Unsupported(Prefix(reader.path()) + field +
                               "/pieces: " + std::to_string(pieces->items().size()) +
                               " pieces; ucp reads slices of one piece each");
  }
  const Value* piece = pieces->items()[0];
  if (piece->kind() != Kind::kDict) return corrupt("pieces/0", "not a dict");
  WholeRankPiece out;
  out.shard = AsShape(*shard);
  const std::optional<std::vector<int64_t>> shape = Ints(piece->Get("shape"));
  if (!shape || !NonNegative(*shape)) return corrupt("pieces/0/shape", "not a list of sizes");
  out.shape = AsShape(*shape);
  for (const auto& [member, offset, strides] :
       {std::tuple{"source", &out.source_offset, &out.source_strides},
        std::tuple{"dest", &out.dest_offset, &out.dest_strides}}) {
    const Value* view = piece->Get(member);
    const std::string at = std::string("pieces/0/") + member;
    if (view == nullptr || (view->kind() != Kind::kList && view->kind() != Kind::kTuple) ||
        view->items().size() != 2 || view->items()[0]->kind() != Kind::kInt ||
        !view->items()[0]->AsInt64()) {
      return corrupt(at, "not [offset, strides]");
    }
    const std::optional<std::vector<int64_t>> view_strides = Ints(view->items()[1]);
    if (!view_strides || !NonNegative(*view_strides)) return corrupt(at, "strides not sizes");
    *offset = *view->items()[0]->AsInt64();
    *strides = AsShape(*view_strides);
  }
  const std::optional<std::vector<int64_t>> locations = Ints(piece->Get("locations"));
  if (!locations) return corrupt("pieces/0/locations", "not a list of ranks");
  out.locations = *locations;
  if (const Value* scale = piece->Get("scale");
      scale != nullptr && !(scale->kind() == Kind::kFloat && scale->float_value() == 1.0) &&
      !(scale->kind() == Kind::kInt && scale->AsInt64() == 1)) {
    return Status::Unsupported(Prefix(reader.path()) + field +
                               "/pieces/0/scale: a scaled slice; ucp reads unscaled ones");
  }
  return out;
}

// The shard map of one affine_map entry at degree tp.
Result<std::pair<ShardMap, Shape>> MapOfEntry(const TorchArchiveReader& reader,
                                              const std::string& field, const Value* entry,
                                              uint32_t tp) {
  if (entry->kind() != Kind::kDict) return FieldError(reader, field, "not a dict");
  const std::optional<std::vector<int64_t>> logical = Ints(entry->Get("logical_shape"));
  if (!logical || !NonNegative(*logical)) {
    return FieldError(reader, field + "/logical_shape", "not a list of sizes");
  }
  const Shape whole = AsShape(*logical);
  const Shape whole_strides = ContiguousStrides(whole);
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
  std::optional<ShardMap> agreed;
  std::vector<uint64_t> blocks;  // split: each rank's extent along the split dimension
  for (uint32_t t = 0; t < tp; ++t) {
    const std::string at = field + "/ranks/" + std::to_string(t);
    UCP_ASSIGN_OR_RETURN(const WholeRankPiece piece, ReadRankPiece(reader, at, by_rank[t]));
    const auto unsupported = [&](const std::string& what) {
      return Status::Unsupported(Prefix(reader.path()) + at + ": " + what +
                                 "; ucp reads replicated slices and even contiguous splits");
    };
    if (piece.shape != piece.shard || piece.dest_offset != 0 ||
        piece.dest_strides != ContiguousStrides(piece.shard) ||
        piece.source_strides != whole_strides || piece.shard.size() != whole.size()) {
      return unsupported("a piece other than the whole slice, or a strided view");
    }
    ShardMap map;
    std::vector<size_t> cut;
    for (size_t d = 0; d < whole.size(); ++d) {
      if (piece.shard[d] != whole[d]) cut.push_back(d);
    }
    std::vector<int64_t> all(tp);
    for (uint32_t r = 0; r < tp; ++r) all[r] = r;
    if (cut.empty()) {
      if (piece.source_offset != 0 || piece.locations != all) {
        return unsupported("the whole parameter, but not held by every rank at offset 0");
      }
    } else {
      const size_t d = cut.front();
      uint64_t before = 0;
      for (const uint64_t block : blocks) before += block;
      if (cut.size() != 1 || piece.shard[d] == 0 || piece.locations != std::vector<int64_t>{t} ||
          static_cast<uint64_t>(piece.source_offset) != before * whole_strides[d]) {
        return unsupported("shard_shape " + ShapeText(piece.shard) + " of logical_shape " +
                           ShapeText(whole) + " at this offset is not rank " + std::to_string(t) +
                           "'s block along one dimension, after those of the ranks before it");
      }
      map.rule = Rule::kSplit;
      map.dim = static_cast<uint32_t>(d);
      map.sub_params = {whole[d]};
      blocks.push_back(piece.shard[d]);
    }
    if (agreed && (agreed->rule != map.rule || agreed->dim != map.dim)) {
      return unsupported("another layout than rank 0's");
    }
    agreed = map;
  }
  if (agreed->rule == Rule::kSplit) {
    uint64_t total = 0;
    for (const uint64_t block : blocks) total += block;
    if (total != whole[agreed->dim]) {
      return Status::Unsupported(Prefix(reader.path()) + field + "/ranks: blocks " +
                                 ShapeText(blocks) + " do not make dim " +
                                 std::to_string(agreed->dim) + " of logical_shape " +
                                 ShapeText(whole));
    }
    SetBlocks(*agreed, std::move(blocks));
  }
  return std::pair{*agreed, whole};
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
    const Shape strides = ContiguousStrides(whole);
    std::optional<size_t> cut = split_dim;
    for (size_t d = 0; d < whole.size() && !split_dim; ++d) {
      if (static_cast<uint64_t>((*shard)[d]) != whole[d]) cut = d;
    }
    if (cut && *cut >= whole.size()) {
      return Status::Corrupt(Prefix(where) + field + ": logical_shape " + ShapeText(whole) +
                             " has no dim " + std::to_string(*cut));
    }
    std::vector<uint64_t> extents;  // split: each rank's along the cut
    if (cut) {
      const std::optional<std::string> name =
          key->kind() == Kind::kStr ? LiteralName(key->data()) : std::nullopt;
      const auto given = name ? blocks.find(*name) : blocks.end();
      if (given != blocks.end()) {
        extents = given->second;
      } else if (whole[*cut] % tp == 0) {
        extents.assign(tp, whole[*cut] / tp);
      }
      uint64_t total = 0;
      for (const uint64_t extent : extents) total += extent;
      if (extents.size() != tp || total != whole[*cut]) {
        return Status::Unsupported(Prefix(where) + field + ": logical_shape " + ShapeText(whole) +
                                   " does not split evenly over tp=" + std::to_string(tp) +
                                   " along dim " + std::to_string(*cut) +
                                   ", nor by blocks given for it");
      }
    }
    std::vector<std::pair<Value*, Value*>> new_ranks;
    uint64_t before = 0;  // along the cut, the blocks of the ranks before t
    for (uint32_t t = 0; t < tp; ++t) {
      Shape slice = whole;
      uint64_t offset = 0;
      Shape holders;
      if (cut) {
        slice[*cut] = extents[t];
        offset = before * strides[*cut];
        before += extents[t];
        holders = {t};
      } else {
        for (uint32_t r = 0; r < tp; ++r) holders.push_back(r);
      }
      const auto view = [&](uint64_t at, const Shape& view_strides) {
        return graph.List({graph.Int(static_cast<int64_t>(at)), IntList(graph, view_strides)});
      };
      Value* piece = graph.Dict({{graph.Str("shape"), IntList(graph, slice)},
                                 {graph.Str("source"), view(offset, strides)},
                                 {graph.Str("dest"), view(0, ContiguousStrides(slice))},
                                 {graph.Str("locations"), IntList(graph, holders)}});
      new_ranks.emplace_back(graph.Int(t),
                             graph.Dict({{graph.Str("shard_shape"), IntList(graph, slice)},
                                         {graph.Str("pieces"), graph.List({piece})}}));
    }
    for (auto& [member, value] : entry->mutable_entries()) {
      if (member->kind() == Kind::kStr && member->data() == "ranks") {
        value = graph.Dict(std::move(new_ranks));
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
  return SetAffineMapDegree(graph, affine == nullptr ? nullptr : affine->Get("params"), tp,
                            reader.path(), uneven);
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

Status MapsAtDegree(const AtomIndex& index, uint32_t from, uint32_t to, const AutoTpSplitRule& rule,
                    std::map<std::string, ShardMap>& maps) {
  for (auto& [name, map] : maps) {
    if (map.rule != Rule::kSplit) continue;
    const Atom* atom = index.Find(name, "bit16");  // every parameter's, frozen ones' too
    if (atom == nullptr) return Status::Corrupt("deepspeed: index: no bit16 atom of " + name);
    UCP_ASSIGN_OR_RETURN(const Geometry saved,
                         GeometryAt(name, map, atom->shape, from, std::nullopt, map.blocks));
    UCP_ASSIGN_OR_RETURN(
        std::vector<uint64_t> blocks,
        BlocksAtDegree(name, atom->shape.at(map.dim), SplitBlocks(saved), to, rule));
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
