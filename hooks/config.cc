#include "hooks/config.h"

#include <charconv>
#include <string_view>
#include <utility>

#include "core/util/path.h"

namespace ucp::hooks {
namespace {

// Degrees above this are certainly typos (no job has a million-way parallel dimension).
constexpr int kMaxDegree = 1 << 20;

Status Invalid(std::string_view name, std::string_view value, std::string_view expected) {
  std::string message(name);
  message += '=';
  message += value;
  message += " is invalid (expected ";
  message += expected;
  message += ')';
  return Status::InvalidArgument(std::move(message));
}

// The variable's value, or an empty view when it is unset or empty.
std::string_view Lookup(const EnvLookup& lookup, const char* name) {
  const char* value = lookup(name);
  return value == nullptr ? std::string_view() : std::string_view(value);
}

template <typename T>
Status ParseChoice(const EnvLookup& lookup, const char* name,
                   std::initializer_list<std::pair<std::string_view, T>> choices,
                   std::string_view expected, T* out) {
  const std::string_view value = Lookup(lookup, name);
  if (value.empty()) return Status::Ok();
  for (const auto& [text, choice] : choices) {
    if (value == text) {
      *out = choice;
      return Status::Ok();
    }
  }
  return Invalid(name, value, expected);
}

Status ParseBool(const EnvLookup& lookup, const char* name, bool* out) {
  return ParseChoice<bool>(lookup, name, {{"0", false}, {"1", true}}, "0 or 1", out);
}

Status ParseAbsolutePath(const EnvLookup& lookup, const char* name, std::string* out) {
  const std::string_view value = Lookup(lookup, name);
  if (value.empty()) return Status::Ok();
  if (value.front() != '/') return Invalid(name, value, "an absolute path");
  *out = LexicallyNormal(value);
  return Status::Ok();
}

Status ParseRoots(const EnvLookup& lookup, std::vector<std::string>* out) {
  constexpr const char* kName = "UCP_ROOTS";
  const std::string_view value = Lookup(lookup, kName);
  if (value.empty()) return Status::Ok();
  std::vector<std::string> roots;
  size_t pos = 0;
  while (pos <= value.size()) {
    const size_t colon = value.find(':', pos);
    const size_t end = colon == std::string_view::npos ? value.size() : colon;
    const std::string_view root = value.substr(pos, end - pos);
    if (root.empty() || root.front() != '/') {
      return Invalid(kName, value, "colon-separated absolute directories");
    }
    roots.push_back(LexicallyNormal(root));
    pos = end + 1;
  }
  *out = std::move(roots);
  return Status::Ok();
}

Status ParseTopology(const EnvLookup& lookup, TopologyOverride* out) {
  constexpr const char* kName = "UCP_TOPOLOGY";
  constexpr std::string_view kExpected =
      "comma-separated tp=N, pp=N, dp=N, ep=N with N a positive integer and "
      "partition=uniform|parameters|type, each key at most once";
  const std::string_view value = Lookup(lookup, kName);
  if (value.empty()) return Status::Ok();
  TopologyOverride topology;
  size_t pos = 0;
  while (pos <= value.size()) {
    const size_t comma = value.find(',', pos);
    const size_t end = comma == std::string_view::npos ? value.size() : comma;
    const std::string_view item = value.substr(pos, end - pos);
    const size_t equals = item.find('=');
    if (equals == std::string_view::npos) return Invalid(kName, value, kExpected);
    const std::string_view key = item.substr(0, equals);
    const std::string_view number = item.substr(equals + 1);
    if (key == "partition") {
      const std::optional<LayerPartition> partition = ParseLayerPartition(number);
      if (!partition || topology.partition) return Invalid(kName, value, kExpected);
      topology.partition = partition;
      pos = end + 1;
      continue;
    }
    std::optional<int>* slot = key == "tp"   ? &topology.tp
                               : key == "pp" ? &topology.pp
                               : key == "dp" ? &topology.dp
                               : key == "ep" ? &topology.ep
                                             : nullptr;
    int degree = 0;
    const auto [rest, error] =
        std::from_chars(number.data(), number.data() + number.size(), degree);
    if (slot == nullptr || slot->has_value() || number.empty() || error != std::errc() ||
        rest != number.data() + number.size() || degree <= 0 || degree > kMaxDegree) {
      return Invalid(kName, value, kExpected);
    }
    *slot = degree;
    pos = end + 1;
  }
  *out = topology;
  return Status::Ok();
}

Status ParseMilliseconds(const EnvLookup& lookup, const char* name, int64_t min, int64_t max,
                         std::chrono::milliseconds* out) {
  const std::string_view value = Lookup(lookup, name);
  if (value.empty()) return Status::Ok();
  int64_t ms = 0;
  const auto [rest, error] = std::from_chars(value.data(), value.data() + value.size(), ms);
  if (error != std::errc() || rest != value.data() + value.size() || ms < min || ms > max) {
    return Invalid(name, value,
                   "milliseconds from " + std::to_string(min) + " to " + std::to_string(max));
  }
  *out = std::chrono::milliseconds(ms);
  return Status::Ok();
}

Status ParseKibibytes(const EnvLookup& lookup, const char* name, uint64_t min, uint64_t max,
                      uint64_t* out_bytes) {
  const std::string_view value = Lookup(lookup, name);
  if (value.empty()) return Status::Ok();
  uint64_t kib = 0;
  const auto [rest, error] = std::from_chars(value.data(), value.data() + value.size(), kib);
  if (error != std::errc() || rest != value.data() + value.size() || kib < min || kib > max) {
    return Invalid(name, value, "KiB from " + std::to_string(min) + " to " + std::to_string(max));
  }
  *out_bytes = kib << 10;
  return Status::Ok();
}

Status ParseStackPatterns(const EnvLookup& lookup, std::vector<std::string>* out) {
  constexpr const char* kName = "UCP_STACK_PATTERNS";
  const std::string_view value = Lookup(lookup, kName);
  if (value.empty()) return Status::Ok();
  std::vector<std::string> patterns;
  size_t pos = 0;
  while (pos <= value.size()) {
    const size_t comma = value.find(',', pos);
    const size_t end = comma == std::string_view::npos ? value.size() : comma;
    const std::string_view pattern = value.substr(pos, end - pos);
    if (pattern.empty()) {
      return Invalid(kName, value, "comma-separated non-empty symbol substrings");
    }
    patterns.emplace_back(pattern);
    pos = end + 1;
  }
  *out = std::move(patterns);
  return Status::Ok();
}

}  // namespace

Result<Config> ParseConfig(const EnvLookup& lookup) {
  Config config;
  UCP_RETURN_IF_ERROR(ParseBool(lookup, "UCP_DISABLE", &config.disable));
  UCP_RETURN_IF_ERROR(ParseChoice<Mode>(
      lookup, "UCP_MODE", {{"index", Mode::kIndex}, {"atoms", Mode::kAtoms}, {"off", Mode::kOff}},
      "index, atoms or off", &config.mode));
  UCP_RETURN_IF_ERROR(ParseRoots(lookup, &config.roots));
  UCP_RETURN_IF_ERROR(ParseTopology(lookup, &config.topology));
  UCP_RETURN_IF_ERROR(ParseAbsolutePath(lookup, "UCP_CACHE_DIR", &config.cache_dir));
  UCP_RETURN_IF_ERROR(ParseChoice<log::Level>(lookup, "UCP_LOG_LEVEL",
                                              {{"trace", log::Level::kTrace},
                                               {"debug", log::Level::kDebug},
                                               {"info", log::Level::kInfo},
                                               {"warn", log::Level::kWarn},
                                               {"error", log::Level::kError},
                                               {"off", log::Level::kOff}},
                                              "trace, debug, info, warn, error or off",
                                              &config.log_level));
  UCP_RETURN_IF_ERROR(ParseAbsolutePath(lookup, "UCP_LOG_DIR", &config.log_dir));
  UCP_RETURN_IF_ERROR(ParseBool(lookup, "UCP_STRICT", &config.strict));
  UCP_RETURN_IF_ERROR(ParseChoice<Detect>(lookup, "UCP_DETECT",
                                          {{"name", Detect::kName}, {"stack", Detect::kStack}},
                                          "name or stack", &config.detect));
  UCP_RETURN_IF_ERROR(ParseStackPatterns(lookup, &config.stack_patterns));
  UCP_RETURN_IF_ERROR(ParseAbsolutePath(lookup, "UCP_DUMP_TOPOLOGY", &config.dump_topology));
  UCP_RETURN_IF_ERROR(ParseBool(lookup, "UCP_DURABLE", &config.durable));
  UCP_RETURN_IF_ERROR(
      ParseMilliseconds(lookup, "UCP_LEASE_STALE_MS", 100, 86400000, &config.lease_stale));
  UCP_RETURN_IF_ERROR(
      ParseKibibytes(lookup, "UCP_BUILD_PART_KB", 4, uint64_t{1} << 30, &config.build_part_bytes));
  return config;
}

}  // namespace ucp::hooks
