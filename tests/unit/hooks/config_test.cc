#include "hooks/config.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace ucp::hooks {
namespace {

using Env = std::map<std::string, std::string>;

Result<Config> Parse(const Env& env) {
  return ParseConfig([&env](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

// The message for a bad value, or "" when it parsed.
std::string ErrorOf(const Env& env) {
  const Result<Config> config = Parse(env);
  EXPECT_TRUE(config.ok() || config.status().code() == StatusCode::kInvalidArgument);
  return config.ok() ? "" : config.status().message();
}

TEST(ConfigTest, DefaultsWhenNothingIsSet) {
  const Result<Config> config = Parse({});
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_FALSE(config->disable);
  EXPECT_EQ(config->mode, Mode::kIndex);
  EXPECT_TRUE(config->roots.empty());
  EXPECT_TRUE(config->topology.empty());
  EXPECT_EQ(config->cache_dir, "");
  EXPECT_EQ(config->log_level, log::Level::kWarn);
  EXPECT_EQ(config->log_dir, "");
  EXPECT_FALSE(config->strict);
  EXPECT_EQ(config->detect, Detect::kName);
  EXPECT_EQ(config->stack_patterns, std::vector<std::string>{"PyTorchStreamWriter"});
  EXPECT_EQ(config->dump_topology, "");
  EXPECT_FALSE(config->durable);
  EXPECT_TRUE(config->active());
}

TEST(ConfigTest, EmptyValuesMeanUnset) {
  const Result<Config> config =
      Parse({{"UCP_MODE", ""}, {"UCP_DISABLE", ""}, {"UCP_TOPOLOGY", ""}, {"UCP_ROOTS", ""}});
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->mode, Mode::kIndex);
  EXPECT_FALSE(config->disable);
  EXPECT_TRUE(config->topology.empty());
  EXPECT_TRUE(config->roots.empty());
}

TEST(ConfigTest, Disable) {
  EXPECT_TRUE(Parse({{"UCP_DISABLE", "1"}})->disable);
  EXPECT_FALSE(Parse({{"UCP_DISABLE", "1"}})->active());
  EXPECT_FALSE(Parse({{"UCP_DISABLE", "0"}})->disable);
  EXPECT_EQ(ErrorOf({{"UCP_DISABLE", "yes"}}), "UCP_DISABLE=yes is invalid (expected 0 or 1)");
  EXPECT_EQ(ErrorOf({{"UCP_DISABLE", "01"}}), "UCP_DISABLE=01 is invalid (expected 0 or 1)");
}

TEST(ConfigTest, Mode) {
  EXPECT_EQ(Parse({{"UCP_MODE", "index"}})->mode, Mode::kIndex);
  EXPECT_EQ(Parse({{"UCP_MODE", "atoms"}})->mode, Mode::kAtoms);
  EXPECT_EQ(Parse({{"UCP_MODE", "off"}})->mode, Mode::kOff);
  EXPECT_FALSE(Parse({{"UCP_MODE", "off"}})->active());
  EXPECT_EQ(ErrorOf({{"UCP_MODE", "fast"}}),
            "UCP_MODE=fast is invalid (expected index, atoms or off)");
  EXPECT_EQ(ErrorOf({{"UCP_MODE", "INDEX"}}),
            "UCP_MODE=INDEX is invalid (expected index, atoms or off)");
}

TEST(ConfigTest, RootsAreAbsoluteAndNormalised) {
  const Result<Config> config = Parse({{"UCP_ROOTS", "/ckpt//run1/:/scratch/./a/../b"}});
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->roots, (std::vector<std::string>{"/ckpt/run1", "/scratch/b"}));
  const std::string expected = " is invalid (expected colon-separated absolute directories)";
  EXPECT_EQ(ErrorOf({{"UCP_ROOTS", "ckpt"}}), "UCP_ROOTS=ckpt" + expected);
  EXPECT_EQ(ErrorOf({{"UCP_ROOTS", "/a::/b"}}), "UCP_ROOTS=/a::/b" + expected);
  EXPECT_EQ(ErrorOf({{"UCP_ROOTS", "/a:"}}), "UCP_ROOTS=/a:" + expected);
  EXPECT_EQ(ErrorOf({{"UCP_ROOTS", "/a:./b"}}), "UCP_ROOTS=/a:./b" + expected);
}

TEST(ConfigTest, Topology) {
  const Result<Config> full = Parse({{"UCP_TOPOLOGY", "tp=2,pp=2,dp=4"}});
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(full->topology, (TopologyOverride{2, 2, 4, std::nullopt, std::nullopt}));
  const Result<Config> partial = Parse({{"UCP_TOPOLOGY", "dp=8"}});
  ASSERT_TRUE(partial.ok());
  EXPECT_EQ(partial->topology,
            (TopologyOverride{std::nullopt, std::nullopt, 8, std::nullopt, std::nullopt}));
  const Result<Config> reordered = Parse({{"UCP_TOPOLOGY", "dp=3,tp=1"}});
  ASSERT_TRUE(reordered.ok());
  EXPECT_EQ(reordered->topology,
            (TopologyOverride{1, std::nullopt, 3, std::nullopt, std::nullopt}));
  const Result<Config> experts = Parse({{"UCP_TOPOLOGY", "ep=1"}});
  ASSERT_TRUE(experts.ok());
  EXPECT_EQ(experts->topology,
            (TopologyOverride{std::nullopt, std::nullopt, std::nullopt, 1, std::nullopt}));
  const Result<Config> placed = Parse({{"UCP_TOPOLOGY", "pp=4,partition=uniform"}});
  ASSERT_TRUE(placed.ok());
  EXPECT_EQ(placed->topology, (TopologyOverride{std::nullopt, 4, std::nullopt, std::nullopt,
                                                LayerPartition::kUniform}));
  for (const auto& [text, partition] :
       {std::pair{"partition=parameters", LayerPartition::kParameters},
        std::pair{"partition=type", LayerPartition::kType}}) {
    const Result<Config> told = Parse({{"UCP_TOPOLOGY", text}});
    ASSERT_TRUE(told.ok()) << text;
    EXPECT_EQ(told->topology.partition, partition) << text;
  }

  const std::string expected =
      " is invalid (expected comma-separated tp=N, pp=N, dp=N, ep=N with N a positive integer and "
      "partition=uniform|parameters|type, each key at most once)";
  for (const char* bad : {"tp=0",
                          "tp=-1",
                          "tp=2,tp=2",
                          "ep=0",
                          "ep=1,ep=1",
                          "sp=2",
                          "tp",
                          "tp=",
                          "tp=2,",
                          ",tp=2",
                          "tp=2;pp=2",
                          "tp=x",
                          "tp=2x",
                          "tp= 2",
                          "TP=2",
                          "dp=99999999999",
                          "dp=2097152",
                          "partition=",
                          "partition=type:transformer",
                          "partition=Uniform",
                          "partition=uniform,partition=uniform"}) {
    EXPECT_EQ(ErrorOf({{"UCP_TOPOLOGY", bad}}), std::string("UCP_TOPOLOGY=") + bad + expected)
        << bad;
  }
}

TEST(ConfigTest, CacheDir) {
  EXPECT_EQ(Parse({{"UCP_CACHE_DIR", "/tmp/ucp/views/"}})->cache_dir, "/tmp/ucp/views");
  EXPECT_EQ(ErrorOf({{"UCP_CACHE_DIR", "views"}}),
            "UCP_CACHE_DIR=views is invalid (expected an absolute path)");
}

TEST(ConfigTest, LogLevel) {
  const std::pair<const char*, log::Level> kLevels[] = {
      {"trace", log::Level::kTrace}, {"debug", log::Level::kDebug}, {"info", log::Level::kInfo},
      {"warn", log::Level::kWarn},   {"error", log::Level::kError}, {"off", log::Level::kOff}};
  for (const auto& [text, level] : kLevels) {
    EXPECT_EQ(Parse({{"UCP_LOG_LEVEL", text}})->log_level, level) << text;
  }
  EXPECT_EQ(ErrorOf({{"UCP_LOG_LEVEL", "verbose"}}),
            "UCP_LOG_LEVEL=verbose is invalid (expected trace, debug, info, warn, error or off)");
}

TEST(ConfigTest, LogDir) {
  EXPECT_EQ(Parse({{"UCP_LOG_DIR", "/var/log/ucp"}})->log_dir, "/var/log/ucp");
  EXPECT_EQ(ErrorOf({{"UCP_LOG_DIR", "logs"}}),
            "UCP_LOG_DIR=logs is invalid (expected an absolute path)");
}

TEST(ConfigTest, Strict) {
  EXPECT_TRUE(Parse({{"UCP_STRICT", "1"}})->strict);
  EXPECT_FALSE(Parse({{"UCP_STRICT", "0"}})->strict);
  EXPECT_EQ(ErrorOf({{"UCP_STRICT", "true"}}), "UCP_STRICT=true is invalid (expected 0 or 1)");
}

TEST(ConfigTest, Detect) {
  EXPECT_EQ(Parse({{"UCP_DETECT", "name"}})->detect, Detect::kName);
  EXPECT_EQ(Parse({{"UCP_DETECT", "stack"}})->detect, Detect::kStack);
  EXPECT_EQ(ErrorOf({{"UCP_DETECT", "both"}}),
            "UCP_DETECT=both is invalid (expected name or stack)");
}

TEST(ConfigTest, StackPatterns) {
  EXPECT_EQ(Parse({{"UCP_STACK_PATTERNS", "PyTorchStreamWriter,save_state"}})->stack_patterns,
            (std::vector<std::string>{"PyTorchStreamWriter", "save_state"}));
  const std::string expected = " is invalid (expected comma-separated non-empty symbol substrings)";
  EXPECT_EQ(ErrorOf({{"UCP_STACK_PATTERNS", "a,,b"}}), "UCP_STACK_PATTERNS=a,,b" + expected);
  EXPECT_EQ(ErrorOf({{"UCP_STACK_PATTERNS", ","}}), "UCP_STACK_PATTERNS=," + expected);
}

TEST(ConfigTest, DumpTopology) {
  EXPECT_EQ(Parse({{"UCP_DUMP_TOPOLOGY", "/tmp/topology.json"}})->dump_topology,
            "/tmp/topology.json");
  EXPECT_EQ(ErrorOf({{"UCP_DUMP_TOPOLOGY", "topology.json"}}),
            "UCP_DUMP_TOPOLOGY=topology.json is invalid (expected an absolute path)");
}

TEST(ConfigTest, Durable) {
  EXPECT_TRUE(Parse({{"UCP_DURABLE", "1"}})->durable);
  EXPECT_FALSE(Parse({{"UCP_DURABLE", "0"}})->durable);
  EXPECT_FALSE(Parse({{"UCP_DURABLE", ""}})->durable);
  EXPECT_EQ(ErrorOf({{"UCP_DURABLE", "yes"}}), "UCP_DURABLE=yes is invalid (expected 0 or 1)");
  EXPECT_EQ(ErrorOf({{"UCP_DURABLE", " 1"}}), "UCP_DURABLE= 1 is invalid (expected 0 or 1)");
  EXPECT_EQ(ErrorOf({{"UCP_DURABLE", "2"}, {"UCP_DUMP_TOPOLOGY", "x"}}),
            "UCP_DUMP_TOPOLOGY=x is invalid (expected an absolute path)");
}

TEST(ConfigTest, LeaseStale) {
  EXPECT_EQ(Parse({})->lease_stale, std::chrono::milliseconds(30000));
  EXPECT_EQ(Parse({{"UCP_LEASE_STALE_MS", "500"}})->lease_stale, std::chrono::milliseconds(500));
  EXPECT_EQ(Parse({})->build_part_bytes, uint64_t{1} << 30);
  EXPECT_EQ(Parse({{"UCP_BUILD_PART_KB", "64"}})->build_part_bytes, uint64_t{64} << 10);
  EXPECT_EQ(ErrorOf({{"UCP_BUILD_PART_KB", "3"}}),
            "UCP_BUILD_PART_KB=3 is invalid (expected KiB from 4 to 1073741824)");
  EXPECT_EQ(ErrorOf({{"UCP_BUILD_PART_KB", "1G"}}),
            "UCP_BUILD_PART_KB=1G is invalid (expected KiB from 4 to 1073741824)");
  EXPECT_EQ(ErrorOf({{"UCP_LEASE_STALE_MS", "99"}}),
            "UCP_LEASE_STALE_MS=99 is invalid (expected milliseconds from 100 to 86400000)");
  EXPECT_EQ(ErrorOf({{"UCP_LEASE_STALE_MS", "5s"}}),
            "UCP_LEASE_STALE_MS=5s is invalid (expected milliseconds from 100 to 86400000)");
}

TEST(ConfigTest, FirstBadVariableIsReported) {
  EXPECT_EQ(ErrorOf({{"UCP_MODE", "fast"}, {"UCP_STRICT", "2"}}),
            "UCP_MODE=fast is invalid (expected index, atoms or off)");
}

}  // namespace
}  // namespace ucp::hooks
