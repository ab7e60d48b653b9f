#include "core/frameworks/deepspeed/autoep.h"

#include <optional>

#include "core/frameworks/deepspeed/autotp.h"
#include "core/frameworks/deepspeed/common.h"
#include "core/frameworks/deepspeed/tp_shards.h"

namespace ucp::deepspeed {

using pickle::Kind;
using pickle::Value;

Result<std::vector<uint32_t>> ReadNumExperts(const TorchArchiveReader& model) {
  UCP_ASSIGN_OR_RETURN(const std::vector<int64_t> counts, IntListField(model, "num_experts"));
  if (counts.empty()) return FieldError(model, "num_experts", "empty: no MoE layer");
  std::vector<uint32_t> num_experts;
  for (const int64_t n : counts) {
    if (n <= 0 || n > kMaxExperts) {
      return FieldError(model, "num_experts", ListText(counts) + ": out of range");
    }
    num_experts.push_back(static_cast<uint32_t>(n));
  }
  return num_experts;
}

Result<uint32_t> ReadAutoEpLayers(const TorchArchiveReader& model,
                                  const std::vector<uint32_t>& num_experts, uint32_t dp,
                                  std::string_view format,
                                  std::vector<std::string>& experts_modules) {
  const std::string root(kAutoEpLayers);
  const size_t layers = num_experts.size();
  if (layers == 0) return FieldError(model, "num_experts", "empty: no MoE layer");
  UCP_ASSIGN_OR_RETURN(const Value* list, Field(model, root));
  if (list->kind() != Kind::kList || list->items().size() != layers) {
    return FieldError(
        model, root,
        "not a list of one entry per MoE layer (num_experts lists " + std::to_string(layers) + ")");
  }
  experts_modules.assign(layers, "");
  std::optional<uint32_t> ep;
  for (size_t i = 0; i < layers; ++i) {
    const std::string field = root + "/" + std::to_string(i);
    UCP_ASSIGN_OR_RETURN(const int64_t layer, IntField(model, field + "/moe_layer_id"));
    if (layer < 0 || static_cast<uint64_t>(layer) >= layers || !experts_modules[layer].empty()) {
      return FieldError(
          model, field + "/moe_layer_id",
          std::to_string(layer) + ": no MoE layer of num_experts, or one listed twice");
    }
    UCP_ASSIGN_OR_RETURN(const std::string saved, StrField(model, field + "/checkpoint_format"));
    if (saved != format) {
      return Status::Unsupported(Prefix(model.path()) + field + "/checkpoint_format: \"" + saved +
                                 "\"; ucp reads AutoEP's " + std::string(format) + " here");
    }
    UCP_ASSIGN_OR_RETURN(const int64_t experts, IntField(model, field + "/num_experts"));
    if (experts != num_experts[layer]) {
      return FieldError(model, field + "/num_experts",
                        std::to_string(experts) + ", but num_experts lists " +
                            std::to_string(num_experts[layer]) + " for layer " +
                            std::to_string(layer));
    }
    UCP_ASSIGN_OR_RETURN(const int64_t size, IntField(model, field + "/ep_size"));
    if (size <= 0 || experts % size != 0 || dp % size != 0 || (ep && *ep != size)) {
      return FieldError(model, field + "/ep_size",
                        std::to_string(size) +
                            ": not an expert-parallel size dividing the layer's " +
                            std::to_string(experts) + " experts and dp_world_size " +
                            std::to_string(dp) + ", alike in every layer");
    }
    ep = static_cast<uint32_t>(size);
    for (const std::string_view key :
         {"ep_rank", "expert_data_parallel_rank", "global_expert_start"}) {
      UCP_ASSIGN_OR_RETURN(const int64_t value, IntField(model, field + "/" + std::string(key)));
      if (value != 0) {
        return FieldError(model, field + "/" + std::string(key),
                          std::to_string(value) + ": rank 0's model states record rank 0's");
      }
    }
    const std::string placement = field + "/expert_placement/ranks";
    UCP_ASSIGN_OR_RETURN(const Value* ranks, Field(model, placement));
    if (ranks->kind() != Kind::kList || ranks->items().size() != static_cast<size_t>(size)) {
      return FieldError(model, placement,
                        "not a list of ep_size " + std::to_string(size) + " ranks");
    }
    const int64_t per_rank = experts / size;
    for (int64_t e = 0; e < size; ++e) {
      const std::string at = placement + "/" + std::to_string(e);
      UCP_ASSIGN_OR_RETURN(const int64_t rank, IntField(model, at + "/rank"));
      UCP_ASSIGN_OR_RETURN(const std::vector<int64_t> held, IntListField(model, at + "/experts"));
      std::vector<int64_t> run(per_rank);
      for (int64_t k = 0; k < per_rank; ++k) run[k] = e * per_rank + k;
      if (rank != e || held != run) {
        return Status::Unsupported(Prefix(model.path()) + at + ": rank " + std::to_string(rank) +
                                   " holding experts " + ListText(held) +
                                   "; ucp reads expert-parallel rank " + std::to_string(e) +
                                   " holding " + ListText(run));
      }
    }
    UCP_ASSIGN_OR_RETURN(experts_modules[layer], StrField(model, field + "/expert_key_prefix"));
  }
  return *ep;
}

Status SetAutoEpLayers(pickle::Graph& graph, Value* root, const ExpertRankOrder& order,
                       uint32_t rank, const TorchArchiveReader& reader) {
  const uint32_t ep = order.ep;
  const uint32_t e = order.ExpertRank(rank);
  std::vector<Value*> lists = {root->Get(kAutoEpLayers)};
  if (Value* info = root->Get(deepspeed::kUniversalCheckpointInfo); info != nullptr) {
    if (Value* copy = info->Get(kAutoEpLayers); copy != nullptr) lists.push_back(copy);
  }
  const auto integer = [&](uint64_t value) { return graph.Int(static_cast<int64_t>(value)); };
  for (Value* list : lists) {
    if (list == nullptr || list->kind() != Kind::kList) {
      return FieldError(reader, kAutoEpLayers, "not a list");
    }
    for (size_t i = 0; i < list->items().size(); ++i) {
      Value* layer = list->items()[i];
      const std::string field = std::string(kAutoEpLayers) + "/" + std::to_string(i);
      const Value* count = layer->kind() == Kind::kDict ? layer->Get("num_experts") : nullptr;
      const Value* placement =
          layer->kind() == Kind::kDict ? layer->Get("expert_placement") : nullptr;
      const Value* maps = layer->kind() == Kind::kDict ? layer->Get("affine_maps") : nullptr;
      const std::optional<int64_t> experts =
          count != nullptr && count->kind() == Kind::kInt ? count->AsInt64() : std::nullopt;
      if (!experts || *experts <= 0 || *experts % ep != 0 || placement == nullptr ||
          placement->kind() != Kind::kDict || maps == nullptr || maps->kind() != Kind::kDict) {
        return FieldError(reader, field,
                          "no num_experts dividing by " + std::to_string(ep) +
                              ", expert_placement or affine_maps");
      }
      const uint64_t per_rank = static_cast<uint64_t>(*experts) / ep;
      std::vector<Value*> ranks;
      for (uint32_t holder = 0; holder < ep; ++holder) {
        std::vector<Value*> held;
        for (uint64_t k = 0; k < per_rank; ++k) held.push_back(integer(holder * per_rank + k));
        ranks.push_back(graph.Dict({{graph.Str("rank"), integer(holder)},
                                    {graph.Str("experts"), graph.List(std::move(held))}}));
      }
      const std::string where = reader.path();
      Value* mutable_placement = layer->Get("expert_placement");
      UCP_RETURN_IF_ERROR(SetDictItem(mutable_placement, "ep_size", integer(ep), where));
      UCP_RETURN_IF_ERROR(
          SetDictItem(mutable_placement, "ranks", graph.List(std::move(ranks)), where));
      UCP_RETURN_IF_ERROR(SetAffineMapDegree(graph, layer->Get("affine_maps")->Get("params"), ep,
                                             where + ": " + field + "/affine_maps", {},
                                             /*split_dim=*/0));
      for (const auto& [key, value] :
           {std::pair{"num_local_experts", integer(per_rank)}, std::pair{"ep_size", integer(ep)},
            std::pair{"ep_group_name",
                      graph.Str(std::string(kExpertGroupNamePrefix) + std::to_string(ep))},
            std::pair{"ep_rank", integer(e)},
            std::pair{"expert_data_parallel_rank", integer(order.IndexInGroup(rank))},
            std::pair{"expert_data_parallel_world_size", integer(order.dp / ep)},
            std::pair{"global_expert_start", integer(e * per_rank)},
            std::pair{"global_expert_end", integer((e + 1) * per_rank)}}) {
        UCP_RETURN_IF_ERROR(SetDictItem(layer, key, value, where));
      }
    }
  }
  return Status::Ok();
}

}  // namespace ucp::deepspeed
