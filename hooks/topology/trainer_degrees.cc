#include "hooks/topology/trainer_degrees.h"

#include <charconv>
#include <cstddef>
#include <span>
#include <string_view>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/io/file.h"

namespace ucp::hooks {
namespace {

constexpr std::string_view kTensorFlag = "--tensor-model-parallel-size";
constexpr std::string_view kPipelineFlag = "--pipeline-model-parallel-size";
constexpr std::string_view kExpertFlag = "--expert-model-parallel-size";
constexpr std::string_view kExpertWorldFlag = "--ep-world-size";
constexpr std::string_view kConfigFlags[] = {"--deepspeed_config", "--deepspeed"};

std::optional<uint32_t> PositiveInt(std::string_view text) {
  uint32_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() || value == 0) {
    return std::nullopt;
  }
  return value;
}

// The value of `flag` at arguments[i] ("--flag=V" or "--flag V"), advancing i past it; nullopt
// when arguments[i] is not that flag.
std::optional<std::string> FlagValue(const std::vector<std::string>& arguments, size_t& i,
                                     std::string_view flag) {
  const std::string& argument = arguments[i];
  if (argument.size() > flag.size() && argument.compare(0, flag.size(), flag) == 0 &&
      argument[flag.size()] == '=') {
    return argument.substr(flag.size() + 1);
  }
  if (argument == flag && i + 1 < arguments.size()) return arguments[++i];
  return std::nullopt;
}

bool EndsWith(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

// Whether a DeepSpeed config section says "enabled": true (the default of those that take it
// being off).
bool Enabled(const nlohmann::json& section) {
  const auto enabled = section.find("enabled");
  return enabled != section.end() && enabled->is_boolean() && enabled->get<bool>();
}

// The degree `config`'s section.key gives (tensor_parallel.autotp_size; expert_parallel's
// autoep_size, which states nothing unless the section is "enabled": true, DeepSpeed's default
// being off), into `degree` and `evidence` unless a flag gave another (kFailedPrecondition naming
// both) or the same.
Status ConfigDegree(const nlohmann::json& config, const std::string& path,
                    std::string_view section_name, std::string_view key, std::string_view axis,
                    bool needs_enabled, std::optional<uint32_t>& degree, std::string& evidence) {
  const auto section = config.find(section_name);
  if (section == config.end() || !section->is_object() || !section->contains(key)) {
    return Status::Ok();
  }
  if (needs_enabled && !Enabled(*section)) return Status::Ok();
  const std::string field = std::string(section_name) + "." + std::string(key);
  const nlohmann::json& size = (*section)[std::string(key)];
  if (!size.is_number_unsigned() || size.get<uint64_t>() == 0 ||
      size.get<uint64_t>() > UINT32_MAX) {
    return Status::FailedPrecondition("trainer arguments: " + path + ": " + field + " " +
                                      size.dump() + " is not a positive integer");
  }
  const uint32_t value = size.get<uint32_t>();
  const std::string stated = path + " " + field + " " + std::to_string(value);
  if (degree && *degree != value) {
    return Status::FailedPrecondition("trainer arguments disagree on " + std::string(axis) + ": " +
                                      evidence + ", but " + stated);
  }
  degree = value;
  if (evidence.empty()) evidence = stated;
  return Status::Ok();
}

}  // namespace

std::vector<std::string> ProcessArguments(uint64_t limit) {
  Result<File> file = File::Open("/proc/self/cmdline", File::Mode::kRead);
  if (!file.ok()) return {};
  std::string text;
  std::byte buffer[4096];
  while (text.size() < limit) {
    Result<size_t> got = file->ReadSomeAt(text.size(), std::span(buffer));
    if (!got.ok() || *got == 0) break;
    text.append(reinterpret_cast<const char*>(buffer), *got);
  }
  if (text.size() > limit) text.resize(limit);
  return SplitCommandLine(text);
}

std::vector<std::string> SplitCommandLine(const std::string& cmdline) {
  std::vector<std::string> arguments;
  size_t start = 0;
  while (start < cmdline.size()) {
    const size_t end = cmdline.find('\0', start);
    const size_t stop = end == std::string::npos ? cmdline.size() : end;
    arguments.push_back(cmdline.substr(start, stop - start));
    start = stop + 1;
  }
  return arguments;
}

Result<TrainerDegrees> DegreesFromArguments(const std::vector<std::string>& arguments,
                                            const ReadFileFunction& read_file) {
  TrainerDegrees degrees;
  std::optional<std::string> config_path;
  std::string config_flag;
  for (size_t i = 0; i < arguments.size(); ++i) {
    for (const auto& [flag, degree, evidence] :
         {std::tuple{kTensorFlag, &degrees.tp, &degrees.tp_evidence},
          std::tuple{kPipelineFlag, &degrees.pp, &degrees.pp_evidence},
          std::tuple{kExpertFlag, &degrees.ep, &degrees.ep_evidence},
          std::tuple{kExpertWorldFlag, &degrees.ep, &degrees.ep_evidence}}) {
      std::optional<std::string> value = FlagValue(arguments, i, flag);
      if (!value) continue;
      *degree = PositiveInt(*value);
      if (!*degree) {
        return Status::FailedPrecondition("trainer arguments: " + std::string(flag) + " \"" +
                                          *value + "\" is not a positive integer");
      }
      *evidence = std::string(flag) + " " + *value;
    }
    for (std::string_view flag : kConfigFlags) {
      const size_t at = i;
      std::optional<std::string> value = FlagValue(arguments, i, flag);
      if (!value) continue;
      // DeepSpeed's own --deepspeed is a switch: the next argument is the trainer's, not a path.
      if (!EndsWith(*value, ".json")) {
        i = at;
        continue;
      }
      config_path = std::move(value);
      config_flag = flag;
    }
  }
  if (config_path) {
    Result<std::string> text = read_file(*config_path);
    if (!text.ok()) {
      return Status::FailedPrecondition("trainer arguments: " + config_flag + " " + *config_path +
                                        ": " + text.status().message());
    }
    const nlohmann::json config = nlohmann::json::parse(*text, nullptr, false);
    if (config.is_discarded() || !config.is_object()) {
      return Status::FailedPrecondition("trainer arguments: " + config_flag + " " + *config_path +
                                        ": not a JSON object");
    }
    UCP_RETURN_IF_ERROR(ConfigDegree(config, *config_path, "tensor_parallel", "autotp_size", "tp",
                                     /*needs_enabled=*/false, degrees.tp, degrees.tp_evidence));
    UCP_RETURN_IF_ERROR(ConfigDegree(config, *config_path, "expert_parallel", "autoep_size", "ep",
                                     /*needs_enabled=*/true, degrees.ep, degrees.ep_evidence));
    // DeepSpeed runs AutoEP at the AutoTP size alone (it refuses an mpu's tensor parallelism), 1
    // where the config names none: a T=1 resume of a save folded over AutoTP says so only thus.
    const auto autoep = config.find("expert_parallel");
    if (!degrees.tp && autoep != config.end() && autoep->is_object() && Enabled(*autoep)) {
      degrees.tp = 1;
      degrees.tp_evidence = *config_path +
                            " expert_parallel enabled without tensor_parallel.autotp_size "
                            "(DeepSpeed's AutoEP runs at its AutoTP size only)";
    }
  }
  return degrees;
}

}  // namespace ucp::hooks
