// Export planning: one state of every atom as consolidated tensors in safetensors files, named
// and sharded the way Hugging Face checkpoints are.
//
// Files planned (all in the output directory):
//   model.safetensors                              when every tensor fits one shard, else
//   model-00001-of-0000N.safetensors, ...          shards filled in atom order
//   model.safetensors.index.json                   {"metadata": {"total_size": N},
//                                                   "weight_map": {param: shard file}}, always
// Tensors are named by their atom's param and hold the atom's dtype and global shape; each
// shard's "__metadata__" is {"format": "pt"}, as transformers writes it.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/format/atom_index.h"
#include "core/plan/executor.h"
#include "core/util/status.h"

namespace ucp {

inline constexpr std::string_view kSafetensorsSingleFile = "model.safetensors";
inline constexpr std::string_view kSafetensorsIndexFile = "model.safetensors.index.json";

// Plans the export of state `state` of every atom of `index`. A shard takes tensors in atom
// order until the next would take it past `max_shard_bytes` (0: no limit); a tensor larger than
// the limit gets a shard of its own. kNotFound when no atom has `state` (the message lists the
// states there are); kUnsupported for a dtype safetensors cannot name.
[[nodiscard]] Result<OutputPlan> PlanSafetensorsExport(const AtomIndex& index,
                                                       std::string_view state,
                                                       uint64_t max_shard_bytes);

}  // namespace ucp
