#include "core/frameworks/deepspeed/megatron_rules.h"

#include <initializer_list>
#include <string_view>

#include "core/format/torch_archive_writer.h"
#include "core/frameworks/deepspeed/common.h"
#include "core/plan/copy_plan.h"
#include "core/util/checked.h"

namespace ucp::deepspeed {
namespace {

using pickle::Kind;
using pickle::Value;

constexpr std::string_view kInfo = kUniversalCheckpointInfo;

// A Python regex as ECMAScript (the patterns Megatron-DeepSpeed writes use the common subset).
Result<std::regex> Compile(const TorchArchiveReader& r, const std::string& field,
                           const Value* node) {
  if (node->kind() != Kind::kStr) return FieldError(r, field, "not a str");
  try {
    return std::regex(node->data(), std::regex::ECMAScript);
  } catch (const std::regex_error&) {
    return Status::Unsupported(Prefix(r.path()) + field + ": pattern \"" + node->data() +
                               "\" is not a regular expression ucp can use");
  }
}

Result<std::vector<std::regex>> PatternList(const TorchArchiveReader& r, const std::string& key) {
  std::vector<std::regex> out;
  const std::string field = std::string(kInfo) + "/" + key;
  const Value* node = OptionalField(r, field);
  if (node == nullptr) return out;
  if (node->kind() != Kind::kList && node->kind() != Kind::kTuple) {
    return FieldError(r, field, "not a list of patterns");
  }
  for (size_t i = 0; i < node->items().size(); ++i) {
    UCP_ASSIGN_OR_RETURN(std::regex re,
                         Compile(r, field + "/" + std::to_string(i), node->items()[i]));
    out.push_back(std::move(re));
  }
  return out;
}

bool Contains(const std::string& name, std::initializer_list<std::string_view> parts) {
  for (const std::string_view part : parts) {
    if (name.find(part) != std::string::npos) return true;
  }
  return false;
}

// The entries ds_to_universal writes beside a parameter's merged tensor for its shard map (the
// SubparamShape object from the client's universal_checkpoint_info entry).
Status AddUniversalMapEntries(pickle::Graph& graph, const ShardMap& map,
                              const TorchArchiveReader& model,
                              std::vector<std::pair<Value*, Value*>>& entries) {
  // ds_to_universal concatenates a parameter no pattern names on dim 0.
  if (map.rule == Rule::kUnnamed) entries.emplace_back(graph.Str("cat_dim"), graph.Int(0));
  switch (map.universal) {
    case UniversalForm::kNone:
      break;
    case UniversalForm::kCatDim:
      entries.emplace_back(graph.Str("cat_dim"), graph.Int(map.dim));
      break;
    case UniversalForm::kNSubParams:
      entries.emplace_back(graph.Str("cat_dim"), graph.Int(map.dim));
      entries.emplace_back(graph.Str("param_n_sub_params"),
                           graph.Int(static_cast<int64_t>(map.sub_params.size())));
      break;
    case UniversalForm::kSubParamShape: {
      const std::string field =
          std::string(kInfo) + "/parameter_with_sub_params/" + std::to_string(map.sub_param_shape);
      std::vector<std::pair<Value*, Value*>> fields;
      for (const char* key : {"patterns", "shape", "partition_dim"}) {
        UCP_ASSIGN_OR_RETURN(const Value* value, Field(model, field + "/" + key));
        fields.emplace_back(graph.Str(key), graph.Import(value));
      }
      Value* object =
          graph.Object(pickle::Construction::kNewObj,
                       graph.Global("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"),
                       graph.Tuple({}));
      object->mutable_mutations().push_back(
          {pickle::Mutation::Op::kBuild, graph.Dict(std::move(fields)), nullptr});
      entries.emplace_back(graph.Str("sub_param_shape"), object);
      break;
    }
  }
  return Status::Ok();
}

}  // namespace

Result<Patterns> ReadPatterns(const TorchArchiveReader& r) {
  Patterns p;
  UCP_ASSIGN_OR_RETURN(p.replicated, PatternList(r, "tp_replicated_parameter_patterns"));
  UCP_ASSIGN_OR_RETURN(p.averaged, PatternList(r, "parameter_to_average_patterns"));
  UCP_ASSIGN_OR_RETURN(p.row_parallel, PatternList(r, "parameter_with_row_parallelism_patterns"));
  UCP_ASSIGN_OR_RETURN(p.vocabulary, PatternList(r, "vocabulary_parameter_patterns"));
  UCP_ASSIGN_OR_RETURN(p.two_sub_params, PatternList(r, "parameter_with_2_sub_params_cat_dim_0"));
  UCP_ASSIGN_OR_RETURN(p.pipeline_replicated,
                       PatternList(r, "pipeline_replicated_parameter_patterns"));
  const std::string sub_field = std::string(kInfo) + "/parameter_with_sub_params";
  if (const Value* list = OptionalField(r, sub_field)) {
    if (list->kind() != Kind::kList && list->kind() != Kind::kTuple) {
      return FieldError(r, sub_field, "not a list");
    }
    for (size_t i = 0; i < list->items().size(); ++i) {
      const std::string field = sub_field + "/" + std::to_string(i) + "/patterns";
      UCP_ASSIGN_OR_RETURN(const Value* patterns, Field(r, field));
      if (patterns->kind() != Kind::kList && patterns->kind() != Kind::kTuple) {
        return FieldError(r, field, "not a list of patterns");
      }
      std::vector<std::regex> res;
      for (size_t j = 0; j < patterns->items().size(); ++j) {
        UCP_ASSIGN_OR_RETURN(std::regex re,
                             Compile(r, field + "/" + std::to_string(j), patterns->items()[j]));
        res.push_back(std::move(re));
      }
      p.sub_params.push_back(std::move(res));
    }
  }
  if (OptionalField(r, std::string(kInfo) + "/original_vocab_size") != nullptr) {
    UCP_ASSIGN_OR_RETURN(p.original_vocab,
                         IntField(r, std::string(kInfo) + "/original_vocab_size"));
  }
  if (OptionalField(r, std::string(kInfo) + "/padded_vocab_size") != nullptr) {
    UCP_ASSIGN_OR_RETURN(p.padded_vocab, IntField(r, std::string(kInfo) + "/padded_vocab_size"));
  }
  return p;
}

bool AnyMatch(const std::vector<std::regex>& patterns, const std::string& name) {
  for (const std::regex& re : patterns) {
    if (std::regex_search(name, re, std::regex_constants::match_continuous)) return true;
  }
  return false;
}

Result<Resolved> Resolve(const TorchArchiveReader& r, const Patterns& patterns,
                         const std::string& name, const Shape& local, uint32_t tp) {
  Resolved out;
  out.atom = local;
  const auto unsupported = [&](const std::string& what) {
    return Status::Unsupported(Prefix(r.path()) + name + ": " + what);
  };
  // Every dimension times tp fits: the full tensor's element count is checked by the index.
  for (const uint64_t dim : local) {
    if (!CheckedMul(dim, uint64_t{tp})) {
      return Status::OutOfRange(Prefix(r.path()) + name + ": " + ShapeText(local) +
                                " × tp=" + std::to_string(tp) + " overflows");
    }
  }
  const bool vocab = AnyMatch(patterns.vocabulary, name);
  ShardMap map;
  if (AnyMatch(patterns.replicated, name) || AnyMatch(patterns.averaged, name)) {
    if (vocab) return unsupported("a vocabulary parameter that is also replicated or averaged");
    map.rule = AnyMatch(patterns.replicated, name) ? Rule::kReplicated : Rule::kAveraged;
    out.map = map;
    out.check_slices = true;
    return out;
  }
  map.rule = Rule::kSplit;
  if (local.empty()) return unsupported("a 0-d parameter cannot be split over TP ranks");
  std::optional<size_t> sub_entry;
  for (size_t i = 0; i < patterns.sub_params.size() && !sub_entry; ++i) {
    if (AnyMatch(patterns.sub_params[i], name)) sub_entry = i;
  }
  if (AnyMatch(patterns.two_sub_params, name)) {
    if (local[0] % 2 != 0) {
      return unsupported("parameter_with_2_sub_params_cat_dim_0 with an odd slice of " +
                         std::to_string(local[0]) + " rows");
    }
    map.universal = UniversalForm::kNSubParams;
    map.sub_params = {local[0] / 2 * tp, local[0] / 2 * tp};
  } else if (sub_entry) {
    const std::string field =
        std::string(kInfo) + "/parameter_with_sub_params/" + std::to_string(*sub_entry);
    UCP_ASSIGN_OR_RETURN(const int64_t partition_dim, IntField(r, field + "/partition_dim"));
    UCP_ASSIGN_OR_RETURN(const Value* shape, Field(r, field + "/shape"));
    if ((shape->kind() != Kind::kList && shape->kind() != Kind::kTuple) ||
        shape->items().size() != local.size() || partition_dim < 0 ||
        static_cast<size_t>(partition_dim) >= local.size()) {
      return unsupported("parameter_with_sub_params shape of another rank than the parameter's " +
                         ShapeText(local));
    }
    map.dim = static_cast<uint32_t>(partition_dim);
    for (size_t d = 0; d < local.size(); ++d) {
      const Value* dim = shape->items()[d];
      std::vector<uint64_t> sizes;
      if (dim->kind() == Kind::kInt) {
        sizes.push_back(static_cast<uint64_t>(dim->AsInt64().value_or(-1)));
      } else if (dim->kind() == Kind::kTuple || dim->kind() == Kind::kList) {
        for (const Value* size : dim->items()) {
          if (size->kind() != Kind::kInt || size->AsInt64().value_or(-1) < 0) {
            return FieldError(r, field + "/shape", "not a shape of ints and tuples of ints");
          }
          sizes.push_back(static_cast<uint64_t>(*size->AsInt64()));
        }
      } else {
        return FieldError(r, field + "/shape", "not a shape of ints and tuples of ints");
      }
      std::optional<uint64_t> sum = 0;
      for (const uint64_t s : sizes) sum = sum ? CheckedAdd(*sum, s) : std::nullopt;
      if (!sum) return FieldError(r, field + "/shape", "sizes overflow");
      const uint64_t total = *sum;
      if (d == map.dim) {
        map.sub_params = sizes;
        if (total != local[d] * tp) {
          return unsupported("parameter_with_sub_params shape " + ShapeText(sizes) + " along dim " +
                             std::to_string(d) + ", but " + std::to_string(tp) + " slices of " +
                             ShapeText(local));
        }
      } else if (total != local[d]) {
        return unsupported("parameter_with_sub_params shape does not match the slice " +
                           ShapeText(local));
      }
    }
    map.universal = UniversalForm::kSubParamShape;
    map.sub_param_shape = static_cast<uint32_t>(*sub_entry);
  } else if (AnyMatch(patterns.row_parallel, name)) {
    if (local.size() < 2) return unsupported("row-parallel, but 1-d");
    map.dim = 1;
    map.universal = UniversalForm::kCatDim;
    map.sub_params = {local[1] * tp};
  } else if (vocab ||
             Contains(name, {"attention.query_key_value", "mlp.dense_h_to_4h.weight",
                             "mlp.dense_h_to_4h.bias", "word_embeddings.weight",
                             "final_linear.weight"}) ||
             (Contains(name, {".deepspeed_experts."}) &&
              (name.ends_with(".dense_h_to_4h.weight") || name.ends_with(".dense_h_to_4h.bias")))) {
    // Named by a vocabulary pattern, or column-parallel by Megatron's naming as DeepSpeed's
    // MegatronSDLoader splits it (on dim 0, as ds_to_universal's default does); an MoE expert
    // that is Megatron's ParallelMLP (expert tensor parallelism) names its own the same way
    // ("….deepspeed_experts.<G>.dense_h_to_4h.weight").
    map.universal = UniversalForm::kCatDim;
    map.sub_params = {local[0] * tp};
  } else {
    out.check_slices = true;
    return out;
  }
  if (vocab) {
    if (map.universal != UniversalForm::kCatDim || map.dim != 0) {
      return unsupported("a vocabulary parameter must be split on dim 0 alone");
    }
    if (!patterns.original_vocab || !patterns.padded_vocab) {
      return FieldError(r, kInfo,
                        "original_vocab_size or padded_vocab_size missing for vocabulary "
                        "parameter " +
                            name);
    }
    if (static_cast<uint64_t>(*patterns.padded_vocab) != local[0] * tp ||
        *patterns.original_vocab < 1 || *patterns.original_vocab > *patterns.padded_vocab) {
      return FieldError(r, std::string(kInfo) + "/padded_vocab_size",
                        std::to_string(*patterns.padded_vocab) + ", but " + name + " has " +
                            std::to_string(tp) + " slices of " + std::to_string(local[0]) +
                            " rows (original_vocab_size " +
                            std::to_string(*patterns.original_vocab) + ")");
    }
    map.vocab = true;
  }
  out.atom[map.dim] = 0;
  for (const uint64_t size : map.sub_params) out.atom[map.dim] += size;
  if (map.vocab) out.atom[0] = static_cast<uint64_t>(*patterns.original_vocab);
  out.map = map;
  return out;
}

// The make_vocab_size_divisible_by that pads `original` to `padded` at degree tp: Megatron's
// default when it does, else the largest power of two that does, else the smallest integer; 0
// when none does. Several values may fit (67 rows padded to 68 at tp=1 fit 2 and 4, which pad to
// 68 and 72 at tp=2): the default is the likeliest, and a run that chose another took a smaller
// multiple. A wrong guess gives the target a vocabulary of another size than its model's, which
// the load refuses rather than misreads.
uint64_t InferDivisibleBy(uint64_t original, uint64_t padded, uint32_t tp) {
  const auto pads = [&](uint64_t m) {
    const Result<uint64_t> got = PaddedVocab({original, padded, m}, tp);
    return got.ok() && *got == padded;
  };
  if (pads(kMegatronVocabDivisibleBy)) return kMegatronVocabDivisibleBy;
  uint64_t largest = 0;
  for (uint64_t m = 1; m <= padded / tp; m *= 2) {
    if (pads(m)) largest = m;
  }
  if (largest != 0) return largest;
  for (uint64_t m = 1; m <= padded / tp; ++m) {
    if (pads(m)) return m;
  }
  return 0;
}

// The vocabulary's sizes: original and padded from universal_checkpoint_info, the padding
// multiple from args.make_vocab_size_divisible_by when saved, else inferred (InferDivisibleBy).
Result<Vocab> ReadVocab(const TorchArchiveReader& r, const Patterns& patterns, uint32_t tp) {
  Vocab vocab{static_cast<uint64_t>(*patterns.original_vocab),
              static_cast<uint64_t>(*patterns.padded_vocab), 0};
  if (const Value* divisor = OptionalField(r, "args/make_vocab_size_divisible_by")) {
    const std::optional<int64_t> value =
        divisor->kind() == Kind::kInt ? divisor->AsInt64() : std::nullopt;
    if (!value || *value < 1) {
      return FieldError(r, "args/make_vocab_size_divisible_by", "not a positive int");
    }
    vocab.divisible_by = static_cast<uint64_t>(*value);
    UCP_ASSIGN_OR_RETURN(const uint64_t padded, PaddedVocab(vocab, tp));
    if (padded != vocab.padded) {
      return FieldError(r, std::string(kInfo) + "/padded_vocab_size",
                        std::to_string(vocab.padded) + ", but Megatron pads " +
                            std::to_string(vocab.original) + " to " + std::to_string(padded) +
                            " at tp=" + std::to_string(tp));
    }
  } else {
    vocab.divisible_by = InferDivisibleBy(vocab.original, vocab.padded, tp);
    if (vocab.divisible_by == 0) {
      return FieldError(r, std::string(kInfo) + "/padded_vocab_size",
                        std::to_string(vocab.padded) + " is no Megatron padding of " +
                            std::to_string(vocab.original) + " at tp=" + std::to_string(tp));
    }
  }
  return vocab;
}

// Megatron-DeepSpeed's load compares tensor_model_parallel_size, pipeline_model_parallel_size and
// padded_vocab_size of the args with its own run's and stops on a mismatch.
Status SetMegatronTopology(pickle::Graph& graph, Value* root, const std::optional<Vocab>& vocab,
                           const Topology& target, const std::string& where) {
  if (vocab) {
    Value* info = root->Get(kInfo);
    if (info != nullptr && info->kind() == Kind::kDict &&
        info->Get("padded_vocab_size") != nullptr) {
      UCP_ASSIGN_OR_RETURN(const uint64_t padded, PaddedVocab(*vocab, target.tp));
      UCP_RETURN_IF_ERROR(
          SetDictItem(info, "padded_vocab_size", graph.Int(static_cast<int64_t>(padded)), where));
    }
  }
  Value* args = root->Get("args");
  if (args == nullptr || args->kind() != Kind::kObject) return Status::Ok();
  std::vector<std::pair<std::string_view, uint64_t>> fields = {
      {"tensor_model_parallel_size", target.tp},
      {"pipeline_model_parallel_size", target.pp},
      {"data_parallel_size", target.dp}};
  if (vocab) {
    UCP_ASSIGN_OR_RETURN(const uint64_t padded, PaddedVocab(*vocab, target.tp));
    fields.emplace_back("padded_vocab_size", padded);
  }
  for (pickle::Mutation& mutation : args->mutable_mutations()) {
    if (mutation.op != pickle::Mutation::Op::kBuild || mutation.first == nullptr ||
        mutation.first->kind() != Kind::kDict) {
      continue;
    }
    for (const auto& [key, value] : fields) {
      const Value* old = mutation.first->Get(key);
      if (old == nullptr || old->kind() != Kind::kInt) continue;
      UCP_RETURN_IF_ERROR(SetDictItem(mutation.first, key, graph.Int(static_cast<int64_t>(value)),
                                      where + ": args"));
    }
  }
  return Status::Ok();
}

Result<ArchiveOutput> UniversalShardedAtom(const AtomIndex& index, const ShardMap& map,
                                           const std::optional<Vocab>& vocab, bool vocabulary,
                                           const TorchArchiveReader& model, const Atom& atom,
                                           bool requires_grad) {
  ArchiveOutput out;
  out.path = "zero/" + atom.param + "/" + atom.state + ".pt";
  UCP_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(atom.shape));
  uint64_t storage_numel = numel;
  if (map.vocab) {
    if (!vocab) {
      return Status::Corrupt("deepspeed: index: " + atom.param +
                             ": a vocabulary parameter of a tag without the vocabulary's sizes");
    }
    // ds_to_universal keeps the merged tensor's storage, padding rows included.
    const std::optional<uint64_t> padded =
        atom.shape[0] == 0 ? std::nullopt : CheckedMul(numel / atom.shape[0], vocab->padded);
    if (!padded) {
      return Status::OutOfRange("deepspeed: " + atom.param + ": padded size overflows");
    }
    storage_numel = *padded;
  }
  TensorNodeSpec spec;
  spec.storage_key = "0";
  spec.dtype = atom.dtype;
  spec.storage_numel = storage_numel;
  spec.shape = atom.shape;
  spec.requires_grad = requires_grad;
  UCP_ASSIGN_OR_RETURN(Value * tensor, MakeTensorNode(out.graph, spec));
  pickle::Graph& graph = out.graph;
  std::vector<std::pair<Value*, Value*>> entries;
  UCP_RETURN_IF_ERROR(AddUniversalMapEntries(graph, map, model, entries));
  if (map.vocab || vocabulary) entries.emplace_back(graph.Str("vocab_tensor"), graph.Bool(true));
  entries.emplace_back(graph.Str("param"), tensor);
  graph.set_root(graph.Dict(std::move(entries)));
  UCP_ASSIGN_OR_RETURN(const Region whole, Region::Whole(atom.shape));
  UCP_ASSIGN_OR_RETURN(std::vector<Segment> segments, PlanRegion(index, atom, whole));
  AppendZeros(segments, (storage_numel - numel) * ItemSize(atom.dtype));
  out.storages.push_back({"0", std::move(segments)});
  return out;
}

}  // namespace ucp::deepspeed
