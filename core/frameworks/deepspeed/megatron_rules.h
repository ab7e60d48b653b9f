// Megatron-DeepSpeed's record of a tensor-parallel layout (universal_checkpoint_info's parameter
// patterns and vocabulary sizes) read into shard maps: which parameters each TP rank holds whole,
// averages, or holds a slice of, and how. The adapters of Megatron-style TP layouts (deepspeed-tp;
// deepspeed-moe with an mpu's TP) share these.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "core/format/atom_index.h"
#include "core/format/pickle_value.h"
#include "core/format/torch_archive_reader.h"
#include "core/frameworks/deepspeed/tp_shards.h"
#include "core/plan/executor.h"
#include "core/util/status.h"

namespace ucp::deepspeed {

// Megatron's default make_vocab_size_divisible_by.
inline constexpr uint64_t kMegatronVocabDivisibleBy = 128;

// universal_checkpoint_info's pattern lists and vocabulary sizes.
struct Patterns {
  std::vector<std::regex> replicated;
  std::vector<std::regex> averaged;
  std::vector<std::regex> row_parallel;
  std::vector<std::regex> vocabulary;
  std::vector<std::regex> two_sub_params;
  std::vector<std::vector<std::regex>> sub_params;  // per parameter_with_sub_params entry
  std::vector<std::regex> pipeline_replicated;
  std::optional<int64_t> original_vocab;
  std::optional<int64_t> padded_vocab;
};

// `r`'s universal_checkpoint_info patterns (none where it has no such entry); kUnsupported for a
// pattern std::regex cannot take, kCorrupt naming the field for one of another type.
Result<Patterns> ReadPatterns(const TorchArchiveReader& r);

// re.match: the pattern matches at the start of the name.
bool AnyMatch(const std::vector<std::regex>& patterns, const std::string& name);

// The shard map of a parameter from its name and TP rank 0's local shape; the atom's shape.
// nullopt map: no rule names it (its slices decide).
struct Resolved {
  std::optional<ShardMap> map;
  Shape atom;
  bool check_slices = false;  // replicated and averaged ones: compare the slices' bytes
};

// Parameter `name` of `r` (local shape `local` on each of tp ranks) by `patterns`, and by
// Megatron's naming of column-parallel parameters (an MoE expert's ParallelMLP's too) where no
// pattern names it.
Result<Resolved> Resolve(const TorchArchiveReader& r, const Patterns& patterns,
                         const std::string& name, const Shape& local, uint32_t tp);

// The make_vocab_size_divisible_by that pads `original` to `padded` at degree tp (0: none does).
uint64_t InferDivisibleBy(uint64_t original, uint64_t padded, uint32_t tp);

// The vocabulary's sizes of `r` saved at degree tp (patterns with both sizes).
Result<Vocab> ReadVocab(const TorchArchiveReader& r, const Patterns& patterns, uint32_t tp);

// Megatron's record of the topology in model states `root` (imported into `graph`) set to
// `target`'s: universal_checkpoint_info's padded_vocab_size at its TP degree (where the vocabulary
// is padded and the entry is there) and the arguments the client saves as "args" (an
// argparse.Namespace) where they name the topology and the padded vocabulary: Megatron-DeepSpeed's
// load compares them with its own run's. `where` names the file.
Status SetMegatronTopology(pickle::Graph& graph, pickle::Value* root,
                           const std::optional<Vocab>& vocab, const Topology& target,
                           const std::string& where);

// zero/<param>/<state>.pt as ds_to_universal writes atom `atom` of a TP-sharded parameter: its
// merged tensor (a vocabulary parameter's storage keeping the padding rows of `vocab`, zeros),
// the entries its shard map `map` gives (the SubparamShape object from `model`'s
// universal_checkpoint_info), and 'vocab_tensor' where the map or `vocabulary` says so.
Result<ArchiveOutput> UniversalShardedAtom(const AtomIndex& index, const ShardMap& map,
                                           const std::optional<Vocab>& vocab, bool vocabulary,
                                           const TorchArchiveReader& model, const Atom& atom,
                                           bool requires_grad);

}  // namespace ucp::deepspeed
