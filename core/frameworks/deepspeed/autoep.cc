#include "core/frameworks/deepspeed/autoep.h"

#include <optional>

#include "core/frameworks/deepspeed/common.h"

namespace ucp::deepspeed {

using pickle::Kind;
using pickle::Value;

Result<uint32_t> ReadAutoEpLayers(const TorchArchiveReader& model,
                                  const std::vector<uint32_t>& num_experts, uint32_t dp,
                                  std::string_view format,
                                  std::vector<std::string>& experts_modules) {
  const std::string root(kAutoEpLayers);
  const size_t layers = num_experts.size();
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

}  // namespace ucp::deepspeed
