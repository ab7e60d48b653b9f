#include "core/util/launcher.h"

#include <charconv>
#include <string_view>

namespace ucp {
namespace {

// A launcher's pair of variables: the world size and this process's rank.
struct LauncherVariables {
  const char* size;
  const char* rank;
};

constexpr LauncherVariables kLaunchers[] = {
    {"WORLD_SIZE", "RANK"},
    {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"},
    {"PMI_SIZE", "PMI_RANK"},
    {"SLURM_NTASKS", "SLURM_PROCID"},
};

// A decimal integer in [minimum, INT32_MAX], the whole string.
std::optional<int> ParseInt(const char* text, int minimum) {
  if (text == nullptr || *text == '\0') return std::nullopt;
  const std::string_view view(text);
  int value = 0;
  const auto [end, error] = std::from_chars(view.data(), view.data() + view.size(), value);
  if (error != std::errc() || end != view.data() + view.size() || value < minimum) {
    return std::nullopt;
  }
  return value;
}

}  // namespace

std::optional<LauncherPosition> LauncherPositionFromEnv(const EnvLookup& env,
                                                        std::vector<std::string>& warnings) {
  for (const LauncherVariables& launcher : kLaunchers) {
    const char* size_text = env(launcher.size);
    if (size_text == nullptr || *size_text == '\0') continue;
    const std::optional<int> size = ParseInt(size_text, 1);
    if (!size) {
      warnings.push_back(std::string(launcher.size) + "=" + size_text +
                         " is not a positive integer; ignored");
      continue;
    }
    LauncherPosition position{*size, std::nullopt, std::string(launcher.size) + "=" + size_text};
    if (const char* rank_text = env(launcher.rank); rank_text != nullptr && *rank_text != '\0') {
      position.rank = ParseInt(rank_text, 0);
      if (!position.rank || *position.rank >= *size) {
        warnings.push_back(std::string(launcher.rank) + "=" + rank_text + " is not a rank below " +
                           launcher.size + "=" + size_text + "; ignored");
        position.rank.reset();
      } else {
        position.text += std::string(" ") + launcher.rank + "=" + rank_text;
      }
    }
    position.text += " (launcher)";
    return position;
  }
  return std::nullopt;
}

}  // namespace ucp
