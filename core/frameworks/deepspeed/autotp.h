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
// ucp takes the two layouts AutoTP writes for whole-rank slices: every rank holds the whole
// parameter (replicated), or rank t holds the t-th of tp equal contiguous blocks along one
// dimension (split: LinearLayer's rows, LinearAllreduce's columns, an evenly split vocabulary).
// Anything else (uneven splits, pieces, scales) is refused naming the parameter and the field.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <map>
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
// held by every rank or the t-th of tp equal blocks along the entry's split dimension.
// kUnsupported naming the pattern where a split dimension does not divide by tp; `where` names
// the source file in messages.
Status SetAffineMapDegree(pickle::Graph& graph, pickle::Value* params, uint32_t tp,
                          const std::string& where);

}  // namespace ucp::deepspeed
