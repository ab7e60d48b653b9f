// How DeepSpeed's AutoTP split each parameter over its tensor-parallel ranks, as it records it in
// every model-states file (DeepSpeed 0.19: universal_checkpoint_info version 0.4):
//   universal_checkpoint_info/affine_map = {"version": 1, "params": {<pattern>: {
//       "logical_shape": [...],                      the whole parameter
//       "ranks": {<t>: {"shard_shape": [...],        TP rank t's slice
//                       "pieces": [{"shape", "source": [offset, strides], "dest": [offset,
//                                   strides], "locations": [TP ranks holding it], "scale"?}]}}}}}
// A piece's source is a torch.as_strided view of the contiguous whole parameter, its dest one of
// the contiguous slice (deepspeed/checkpoint/affine.py). <pattern> is a Python regex of the
// parameter's name, "^<escaped name>$" as AutoTP writes it. Beside it:
// vocabulary_parameter_patterns (ds_to_universal marks those parameters 'vocab_tensor'),
// original_vocab_size, and autotp_unsupported_parameter_patterns (parameters AutoTP could not
// describe).
//
// ucp takes the layouts AutoTP writes for whole-rank slices: every rank holds the whole parameter
// (replicated); rank t holds the t-th of tp contiguous blocks along one dimension, equal or not
// (split: LinearLayer's rows, LinearAllreduce's columns, a vocabulary); or a fused parameter
// (SubParamLinearLayer's: a partition_config shape such as (3, -1) or ((q, k, v), -1)) whose
// parts, the sub-parameters, are each split so, rank t's slice holding its block of each in turn
// (sub_param_map: one piece per part, in equal blocks or not). Anything else (scales, empty
// slices) is refused naming the parameter and the field.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/format/atom_index.h"
#include "core/format/pickle_value.h"
#include "core/format/torch_archive_reader.h"
#include "core/frameworks/deepspeed/tp_shards.h"
#include "core/util/status.h"

namespace ucp::deepspeed {

struct AutoTpMaps {
  std::map<std::string, ShardMap> maps;       // parameter → how its TP slices make it
  std::map<std::string, Shape> whole_shapes;  // parameter → its logical_shape
  std::set<std::string> vocabulary;           // named by vocabulary_parameter_patterns
};

// True when `reader` (a model-states file) carries an AutoTP affine map.
bool HasAutoTpMaps(const TorchArchiveReader& reader);

// The maps of the parameters `names` at TP degree `tp` from `reader`'s
// universal_checkpoint_info. kUnsupported for a parameter no entry describes, a layout other
// than the two above, or parameters AutoTP lists as unsupported; kCorrupt for a malformed entry;
// both name the file and the field.
Result<AutoTpMaps> ReadAutoTpMaps(const TorchArchiveReader& reader, uint32_t tp,
                                  const std::vector<std::string>& names);

// Rewrites `params` (a copy of a model-states file's affine_map/params, read by ReadAutoTpMaps)
// for TP degree `tp`: every entry's "ranks" as AutoTP writes them at that degree, whole slices
// held by every rank, or rank t's block along the entry's split dimension: `blocks`[name][t] for
// the parameter an entry names literally where `blocks` has them (as ShardMap::blocks), else the
// t-th of tp equal ones of each part (the parts' sizes: the sums of the entry's pieces).
// kUnsupported naming the pattern where a split dimension does not divide by tp or the blocks do
// not make it; `where` names the source file in messages. An entry's split dimension is the one
// where rank 0's shard_shape differs from logical_shape, or `split_dim` where given (AutoEP's
// expert dimension, which a map written at size 1 does not show).
Status SetAffineMapDegree(pickle::Graph& graph, pickle::Value* params, uint32_t tp,
                          const std::string& where,
                          const std::map<std::string, std::vector<uint64_t>>& blocks = {},
                          std::optional<size_t> split_dim = std::nullopt);

// The ds_config's tensor_parallel.autotp_size of a file's `root` (model states or optimizer
// states), where it has one, set to `tp`: DeepSpeed saves the config of the run, which trains at
// `tp`. `reader` is the file imported into `graph`, for messages.
Status SetAutoTpSize(pickle::Graph& graph, pickle::Value* root, uint32_t tp,
                     const TorchArchiveReader& reader);

// A model states' record of its TP degree set to `tp`, as DeepSpeed 0.19 writes it there:
// mp_world_size, checkpoint_parallel_dimensions' tp_degree, ds_config's autotp_size, and
// universal_checkpoint_info with the affine map at `tp` (none at tp = 1: DeepSpeed records no
// AutoTP then), the parameters of `uneven` split in its blocks (as ShardMap::blocks), and the
// fused parameters' sub_param_shard_widths so.
Status SetTpDegree(pickle::Graph& graph, pickle::Value* root, uint32_t tp,
                   const TorchArchiveReader& reader,
                   const std::map<std::string, std::vector<uint64_t>>& uneven);

// How AutoTP sizes the blocks of a split dimension of `total` over tp ranks
// (deepspeed/module_inject/tp_shard.py, get_shard_size): near evenly in units of the ds_config's
// tensor_parallel.tp_grain_size, the remainder on the last rank; or, where the model has a config
// whose key/value head count K divides `total`, in whole heads, rank t taking K / tp heads and one
// more for t < K % tp. Which of the two a layer takes depends on its module name as AutoTP saw it,
// which the checkpoint does not record.
struct AutoTpSplitRule {
  uint64_t grain = 1;
  bool model_config = false;         // a config.json lies beside the tag
  std::optional<uint64_t> kv_heads;  // K, read from it
  std::string kv_heads_from;         // "<path>: <key>", for messages
};

// Each rank's block of a dimension of `total` split over `tp` ranks near evenly in units of
// `grain` (the remainder on the last rank), and in whole heads of `kv_heads` (which divide
// `total`); all zero for a tp, grain or kv_heads of 0.
std::vector<uint64_t> GrainBlocks(uint64_t total, uint32_t tp, uint64_t grain);
std::vector<uint64_t> HeadBlocks(uint64_t total, uint32_t tp, uint64_t kv_heads);

// The rule of a tag whose model states `reader` is, in `tag_dir`: the grain from its ds_config,
// the head count from the Hugging Face config.json in the checkpoint folder holding the tag (where
// the HF Trainer and save_pretrained write it), probed by AutoTPMeta's names (text_config first
// where the config has one). Without a config.json the model is taken to have no config, as a
// plain torch module has none. kCorrupt naming the file and the field for a malformed one.
Result<AutoTpSplitRule> ReadAutoTpSplitRule(const TorchArchiveReader& reader,
                                            const std::string& tag_dir);

// The blocks AutoTP splits a dimension of `total` into over `to` ranks, where it split it into
// the `saved` blocks over saved.size() ranks: the way of the rule that gives the saved blocks, or
// either where both give them and agree at `to`. kUnsupported naming `name`, the blocks and the
// reason otherwise: the two ways disagree at `to` and the saved blocks do not say which the layer
// takes; neither gives the saved blocks (the rule read is not the one the model ran with); a
// config.json without a head count; a rank left with an empty slice.
Result<std::vector<uint64_t>> BlocksAtDegree(const std::string& name, uint64_t total,
                                             const std::vector<uint64_t>& saved, uint32_t to,
                                             const AutoTpSplitRule& rule);

// The blocks AutoTP splits a kSplit parameter into at degree `to`, where it split it as `saved`
// (its geometry at the saved degree) shows: each sub-parameter's by BlocksAtDegree, in the layout
// of ShardMap::blocks; kUnsupported naming the parameter and the sub-parameter where the rule
// gives none.
Result<std::vector<uint64_t>> MapBlocksAtDegree(const std::string& name, const Geometry& saved,
                                                uint32_t to, const AutoTpSplitRule& rule);

// `maps` (an AutoTP tag's, saved at TP degree `from`; the whole parameters `index`'s bit16 atoms)
// at degree `to`: each split parameter's blocks there as AutoTP splits it by `rule`
// (BlocksAtDegree); kUnsupported naming the parameter where the rule gives none.
Status MapsAtDegree(const AtomIndex& index, uint32_t from, uint32_t to, const AutoTpSplitRule& rule,
                    std::map<std::string, ShardMap>& maps);

// The affine map entries of `root`'s universal_checkpoint_info (a model states imported into
// `graph` from `reader`) that name the parameters of `shapes` literally, each set to a parameter
// of that shape held whole by every TP rank, for SetTpDegree to lay out its ranks: AutoEP's fused
// experts, which AutoTP records so at [experts per expert-parallel rank, ...]. kCorrupt naming the
// file and the field where no entry names one of them.
Status SetReplicatedShapes(pickle::Graph& graph, pickle::Value* root,
                           const TorchArchiveReader& reader,
                           const std::map<std::string, Shape>& shapes);

}  // namespace ucp::deepspeed
