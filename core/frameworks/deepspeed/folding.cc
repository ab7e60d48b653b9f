#include "core/frameworks/deepspeed/folding.h"

#include <optional>
#include <string>
#include <utility>

#include "core/frameworks/deepspeed/autoep.h"
#include "core/frameworks/deepspeed/common.h"
#include "core/frameworks/deepspeed/tp_shards.h"

namespace ucp::deepspeed {

std::vector<uint32_t> FoldedGrid::ExpertWriters(uint32_t t, uint32_t e) const {
  std::vector<uint32_t> writers;
  for (uint32_t g = 0; g < world; ++g) {
    if (TpRank(g) == t && ExpertRank(g) == e && WritesExperts(g)) writers.push_back(g);
  }
  return writers;
}

std::vector<uint32_t> FoldedGrid::ExpertHolders(uint32_t t, uint32_t e) const {
  std::vector<uint32_t> holders;
  for (uint32_t g = 0; g < world; ++g) {
    if (TpRank(g) == t && ExpertRank(g) == e) holders.push_back(g);
  }
  return holders;
}

Result<std::optional<FoldedGrid>> ReadFoldedGrid(const TorchArchiveReader& model) {
  const std::string dims = "checkpoint_parallel_dimensions";
  const pickle::Value* tp_degree = OptionalField(model, dims + "/tp_degree");
  // Native MoE saves record ds_autoep_layers None.
  const pickle::Value* autoep = OptionalField(model, kAutoEpLayers);
  if (tp_degree == nullptr || autoep == nullptr || autoep->kind() == pickle::Kind::kNone)
    return std::optional<FoldedGrid>();
  UCP_ASSIGN_OR_RETURN(const int64_t tp, IntField(model, dims + "/tp_degree"));
  if (tp <= 1) return std::optional<FoldedGrid>();
  UCP_ASSIGN_OR_RETURN(const int64_t pp, IntField(model, dims + "/pp_degree"));
  if (pp != 1) {
    return Status::Unsupported(Prefix(model.path()) + dims + "/pp_degree " + std::to_string(pp) +
                               ": AutoEP with AutoTP in a pipeline (DeepSpeed does not fold one)");
  }
  UCP_ASSIGN_OR_RETURN(const int64_t mp, IntField(model, "mp_world_size"));
  if (mp != tp) {
    return FieldError(model, "mp_world_size",
                      std::to_string(mp) + ", but tp_degree is " + std::to_string(tp));
  }
  UCP_ASSIGN_OR_RETURN(const uint32_t dp, DpWorldSize(model));
  const std::string folding(kFolding);
  UCP_ASSIGN_OR_RETURN(const int64_t folded_tp, IntField(model, folding + "/tp_size"));
  UCP_ASSIGN_OR_RETURN(const int64_t ep, IntField(model, folding + "/ep_size"));
  UCP_ASSIGN_OR_RETURN(const int64_t etp, IntField(model, folding + "/etp_size"));
  if (folded_tp != tp) {
    return FieldError(model, folding + "/tp_size",
                      std::to_string(folded_tp) + ", but tp_degree is " + std::to_string(tp));
  }
  if (etp != 1) {
    return Status::Unsupported(Prefix(model.path()) + folding + "/etp_size " + std::to_string(etp) +
                               ": expert tensor parallelism is not supported");
  }
  const uint64_t world = static_cast<uint64_t>(dp) * static_cast<uint64_t>(tp);
  if (ep <= 1 || world % static_cast<uint64_t>(ep) != 0 || world > (uint64_t{1} << 24)) {
    return FieldError(model, folding + "/ep_size",
                      std::to_string(ep) + ": not an expert-parallel size above 1 dividing the " +
                          std::to_string(world) + " ranks of dp_world_size " + std::to_string(dp) +
                          " x tp_degree " + std::to_string(tp));
  }
  return std::optional<FoldedGrid>(FoldedGrid{
      static_cast<uint32_t>(world), static_cast<uint32_t>(tp), static_cast<uint32_t>(ep)});
}

Status CheckFolding(const TorchArchiveReader& reader, std::string_view family,
                    const FoldedGrid& grid, uint32_t tp_rank, uint32_t ep_rank,
                    std::optional<uint32_t> zero_rank) {
  const std::string folding(kFolding);
  const auto expect = [&](const char* key, int64_t expected) -> Status {
    UCP_ASSIGN_OR_RETURN(const int64_t value, IntField(reader, folding + "/" + key));
    if (value == expected) return Status::Ok();
    return FieldError(reader, folding + "/" + key,
                      std::to_string(value) + ", expected " + std::to_string(expected) +
                          " (a file of another save, or of another rank)");
  };
  UCP_RETURN_IF_ERROR(expect("version", 1));
  UCP_RETURN_IF_ERROR(expect("tp_size", grid.tp));
  UCP_RETURN_IF_ERROR(expect("ep_size", grid.ep));
  UCP_RETURN_IF_ERROR(expect("tp_rank", tp_rank));
  UCP_RETURN_IF_ERROR(expect("ep_rank", ep_rank));
  if (zero_rank) UCP_RETURN_IF_ERROR(expect("zero_partition_rank", *zero_rank));
  UCP_ASSIGN_OR_RETURN(const std::string read, StrField(reader, folding + "/family"));
  if (read != family) {
    return FieldError(reader, folding + "/family",
                      "\"" + read + "\", expected \"" + std::string(family) + "\"");
  }
  return Status::Ok();
}

namespace {

// The zero partition's (rank, count) of rank `writer` in a folding dict's `group`.
std::optional<std::pair<uint32_t, uint32_t>> ZeroPartition(const FoldedGrid& grid,
                                                           std::string_view group,
                                                           uint32_t writer) {
  if (group == "dense_dp" || group == "per_family") {
    return std::pair{grid.DenseRank(writer), grid.DenseDp()};
  }
  if (group == "edp") return std::pair{grid.ExpertDpRank(writer), grid.ExpertDp()};
  return std::nullopt;
}

// `dict`'s zero_partition_rank and _count for rank `writer`, by its zero_partition_group.
Status SetZeroPartition(pickle::Graph& graph, pickle::Value* dict, const FoldedGrid& grid,
                        uint32_t writer, const TorchArchiveReader& reader,
                        const std::string& field) {
  const pickle::Value* group = dict->Get("zero_partition_group");
  const std::optional<std::pair<uint32_t, uint32_t>> partition =
      group != nullptr && group->kind() == pickle::Kind::kStr
          ? ZeroPartition(grid, group->data(), writer)
          : std::nullopt;
  if (!partition) {
    return FieldError(reader, field + "/zero_partition_group",
                      "not \"dense_dp\", \"per_family\" or \"edp\"");
  }
  UCP_RETURN_IF_ERROR(
      SetDictItem(dict, "zero_partition_rank", graph.Int(partition->first), reader.path()));
  return SetDictItem(dict, "zero_partition_count", graph.Int(partition->second), reader.path());
}

}  // namespace

Status UnfoldAutoTp(pickle::Graph& graph, pickle::Value* root, const TorchArchiveReader& reader) {
  EraseKey(root, kFolding);
  EraseKey(root->Get("ds_config"), "tensor_parallel");
  if (root->Get("mp_world_size") == nullptr) return Status::Ok();  // an optimizer file
  UCP_RETURN_IF_ERROR(SetDictItem(root, "mp_world_size", graph.Int(1), reader.path()));
  pickle::Value* dimensions = root->Get("checkpoint_parallel_dimensions");
  if (dimensions == nullptr || dimensions->kind() != pickle::Kind::kDict) {
    return FieldError(reader, "checkpoint_parallel_dimensions", "not a dict");
  }
  UCP_RETURN_IF_ERROR(SetDictItem(dimensions, "tp_degree", graph.Int(1), reader.path()));
  pickle::Value* info = root->Get(kUniversalCheckpointInfo);
  if (info == nullptr || info->kind() != pickle::Kind::kDict) {
    return FieldError(reader, kUniversalCheckpointInfo, "not a dict");
  }
  std::erase_if(info->mutable_entries(),
                [](const std::pair<pickle::Value*, pickle::Value*>& entry) {
                  const std::string key =
                      entry.first->kind() == pickle::Kind::kStr ? entry.first->data() : "";
                  return key != "universal_checkpoint_version" &&
                         key != "expert_parameter_patterns" && key != kAutoEpLayers;
                });
  return Status::Ok();
}

Status SetFolding(pickle::Graph& graph, pickle::Value* root, const TorchArchiveReader& reader,
                  const FoldedGrid& grid, uint32_t writer) {
  const std::string field(kFolding);
  pickle::Value* folding = root->Get(kFolding);
  if (folding == nullptr || folding->kind() != pickle::Kind::kDict) {
    return FieldError(reader, field, "not a dict");
  }
  for (const auto& [key, value] :
       {std::pair{"tp_size", grid.tp}, std::pair{"tp_rank", grid.TpRank(writer)},
        std::pair{"ep_size", grid.ep}, std::pair{"ep_rank", grid.ExpertRank(writer)}}) {
    UCP_RETURN_IF_ERROR(SetDictItem(folding, key, graph.Int(value), reader.path()));
  }
  UCP_RETURN_IF_ERROR(SetZeroPartition(graph, folding, grid, writer, reader, field));
  pickle::Value* families = folding->Get("param_families");
  if (families == nullptr || families->kind() != pickle::Kind::kDict) return Status::Ok();
  for (auto& [name, family] : families->mutable_entries()) {
    if (family->kind() != pickle::Kind::kDict) continue;  // the model states': a family's name
    UCP_RETURN_IF_ERROR(SetZeroPartition(
        graph, family, grid, writer, reader,
        field + "/param_families/" + (name->kind() == pickle::Kind::kStr ? name->data() : "")));
  }
  return Status::Ok();
}

}  // namespace ucp::deepspeed
