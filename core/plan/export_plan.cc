#include "core/plan/export_plan.h"

#include <cstdio>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/format/safetensors_writer.h"
#include "core/plan/copy_plan.h"
#include "core/util/checked.h"

namespace ucp {
namespace {

std::string ShardName(size_t shard, size_t shards) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", shard + 1, shards);
  return name;
}

}  // namespace

Result<OutputPlan> PlanSafetensorsExport(const AtomIndex& index, std::string_view state,
                                         uint64_t max_shard_bytes) {
  const std::string what = "export safetensors of state \"" + std::string(state) + "\"";
  std::vector<std::vector<SafetensorsOutputTensor>> shards;
  uint64_t shard_bytes = 0;
  uint64_t total = 0;
  std::set<std::string> states;
  for (const Atom& atom : index.atoms()) {
    states.insert(atom.state);
    if (atom.state != state) continue;
    if (!SafetensorsName(atom.dtype)) {
      return Status::Unsupported(what + ": " + atom.param + " is torch." +
                                 std::string(TorchName(atom.dtype)) +
                                 ", which safetensors has no name for");
    }
    UCP_ASSIGN_OR_RETURN(const Region whole, Region::Whole(atom.shape));
    UCP_ASSIGN_OR_RETURN(std::vector<Segment> segments, PlanRegion(index, atom, whole));
    const uint64_t bytes = SegmentBytes(segments);
    const std::optional<uint64_t> sum = CheckedAdd(total, bytes);
    if (!sum) return Status::OutOfRange(what + ": total size overflows");
    total = *sum;
    if (shards.empty() || (max_shard_bytes != 0 && shard_bytes > 0 &&
                           !RangeWithin(shard_bytes, bytes, max_shard_bytes))) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back({atom.param, atom.dtype, atom.shape, std::move(segments)});
    shard_bytes += bytes;
  }
  if (shards.empty()) {
    std::string known;
    for (const std::string& name : states) known += (known.empty() ? "" : ", ") + name;
    return Status::NotFound(
        what + ": no atom has that state (states: " + (known.empty() ? "none" : known) + ")");
  }
  OutputPlan plan;
  SafetensorsIndex safetensors_index;
  safetensors_index.total_size = total;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file =
        shards.size() == 1 ? std::string(kSafetensorsSingleFile) : ShardName(s, shards.size());
    for (const SafetensorsOutputTensor& tensor : shards[s]) {
      safetensors_index.weight_map[tensor.name] = file;
    }
    plan.safetensors.push_back({file, std::move(shards[s]), {{"format", "pt"}}});
  }
  UCP_ASSIGN_OR_RETURN(std::string index_json, SafetensorsIndexJson(safetensors_index));
  plan.texts.push_back({std::string(kSafetensorsIndexFile), std::move(index_json)});
  return plan;
}

}  // namespace ucp
