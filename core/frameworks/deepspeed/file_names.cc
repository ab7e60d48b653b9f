#include "core/frameworks/deepspeed/file_names.h"

#include <cstdio>
#include <regex>

namespace ucp::deepspeed {
namespace {

std::optional<uint32_t> MatchedDecimal(const std::csub_match& digits) {
  return Decimal(std::string_view(digits.first, static_cast<size_t>(digits.length())));
}

}  // namespace

std::optional<uint32_t> Decimal(std::string_view digits) {
  if (digits.empty() || digits.size() > 9) return std::nullopt;
  uint32_t value = 0;
  for (const char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + static_cast<uint32_t>(c - '0');
  }
  return value;
}

std::optional<uint32_t> NumberedLayer(std::string_view name) {
  const size_t dot = name.find('.');
  if (dot == std::string_view::npos) return std::nullopt;
  return Decimal(name.substr(0, dot));
}

std::optional<FileName> ParseFileName(std::string_view name) {
  // Never destroyed: inside the preload, the index builder's thread may run while the process
  // exits, after function-local statics were destroyed.
  static const std::regex& kModel = *new std::regex(R"(mp_rank_(\d{2,})_model_states\.pt)");
  static const std::regex& kZero3Model =
      *new std::regex(R"(zero_pp_rank_(\d+)_mp_rank_(\d{2,})_model_states\.pt)");
  static const std::regex& kOptim =
      *new std::regex(R"((bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d{2,})_optim_states\.pt)");
  static const std::regex& kExpertOptim =
      *new std::regex(R"(expp_rank_(\d+)_mp_rank_(\d{2,})_optim_states\.pt)");
  static const std::regex& kExpertModel =
      *new std::regex(R"(layer_(\d+)_expert_(\d+)_mp_rank_(\d{2,})_model_states\.pt)");
  static const std::regex& kLayer =
      *new std::regex(R"(layer_(\d{2,})(-[a-z]+_\d{2,})*-model_states\.pt)");
  static const std::regex& kTpLayer =
      *new std::regex(R"(layer_(\d{2,})-model_(\d{2,})-model_states\.pt)");

  std::cmatch m;
  const char* begin = name.data();
  const char* end = name.data() + name.size();
  FileName parsed;
  std::optional<uint32_t> a, b, c;
  if (std::regex_match(begin, end, m, kModel)) {
    parsed.kind = FileKind::kModelStates;
    a = MatchedDecimal(m[1]);
    if (!a) return std::nullopt;
    parsed.mp = *a;
  } else if (std::regex_match(begin, end, m, kZero3Model)) {
    parsed.kind = FileKind::kZero3ModelStates;
    a = MatchedDecimal(m[1]), b = MatchedDecimal(m[2]);
    if (!a || !b) return std::nullopt;
    parsed.dp = *a, parsed.mp = *b;
  } else if (std::regex_match(begin, end, m, kOptim)) {
    parsed.kind = FileKind::kOptimStates;
    parsed.prefix = m[1].str();
    a = MatchedDecimal(m[2]), b = MatchedDecimal(m[3]);
    if (!a || !b) return std::nullopt;
    parsed.dp = *a, parsed.mp = *b;
  } else if (std::regex_match(begin, end, m, kExpertOptim)) {
    parsed.kind = FileKind::kExpertOptimStates;
    a = MatchedDecimal(m[1]), b = MatchedDecimal(m[2]);
    if (!a || !b) return std::nullopt;
    parsed.dp = *a, parsed.mp = *b;
  } else if (std::regex_match(begin, end, m, kExpertModel)) {
    parsed.kind = FileKind::kExpertModelStates;
    a = MatchedDecimal(m[1]), b = MatchedDecimal(m[2]), c = MatchedDecimal(m[3]);
    if (!a || !b || !c) return std::nullopt;
    parsed.layer = *a, parsed.expert = *b, parsed.mp = *c;
  } else if (std::regex_match(begin, end, m, kTpLayer)) {
    parsed.kind = FileKind::kLayerStates;
    a = MatchedDecimal(m[1]), b = MatchedDecimal(m[2]);
    if (!a || !b) return std::nullopt;
    parsed.layer = *a, parsed.model_rank = *b;
  } else if (std::regex_match(begin, end, m, kLayer)) {
    parsed.kind = FileKind::kLayerStates;
    a = MatchedDecimal(m[1]);
    if (!a) return std::nullopt;
    parsed.layer = *a;
  } else {
    return std::nullopt;
  }
  return parsed;
}

std::string ModelStatesName(uint32_t mp) {
  char name[64];
  std::snprintf(name, sizeof(name), "mp_rank_%02u_model_states.pt", mp);
  return name;
}

std::string Zero3ModelStatesName(uint32_t dp, uint32_t mp) {
  char name[96];
  std::snprintf(name, sizeof(name), "zero_pp_rank_%u_mp_rank_%02u_model_states.pt", dp, mp);
  return name;
}

std::string OptimName(std::string_view prefix, uint32_t dp, uint32_t mp) {
  char name[96];
  std::snprintf(name, sizeof(name), "zero_pp_rank_%u_mp_rank_%02u_optim_states.pt", dp, mp);
  return std::string(prefix) + name;
}

std::string LayerStatesName(uint32_t layer) {
  char name[48];
  std::snprintf(name, sizeof(name), "layer_%02u-model_states.pt", layer);
  return name;
}

std::string TpLayerStatesName(uint32_t layer, uint32_t tp) {
  char name[64];
  std::snprintf(name, sizeof(name), "layer_%02u-model_%02u-model_states.pt", layer, tp);
  return name;
}

std::string ExpertModelStatesName(uint32_t layer, uint32_t expert, uint32_t mp) {
  char name[96];
  std::snprintf(name, sizeof(name), "layer_%u_expert_%u_mp_rank_%02u_model_states.pt", layer,
                expert, mp);
  return name;
}

std::string ExpertOptimName(uint32_t ep, uint32_t mp) {
  char name[64];
  std::snprintf(name, sizeof(name), "expp_rank_%u_mp_rank_%02u_optim_states.pt", ep, mp);
  return name;
}

}  // namespace ucp::deepspeed
