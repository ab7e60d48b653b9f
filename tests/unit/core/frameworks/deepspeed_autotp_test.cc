// AutoTP's affine maps read into shard maps: the layouts DeepSpeed 0.19 writes (the live check,
// tests/e2e_deepspeed/ds_autotp_e2e.py, holds the export to DeepSpeed's converter), and every
// other layout refused naming the file and the field.
#include "core/frameworks/deepspeed/autotp.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/format/pickle_value.h"
#include "core/format/torch_archive_writer.h"
#include "tests/unit/core/frameworks/deepspeed_testing.h"

namespace ucp::deepspeed {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Json = nlohmann::json;
using deepspeed_testing::TempDir;

// The pickle of `json`: objects as dicts (keys of digits as ints, as AutoTP's rank keys), arrays
// as lists.
pickle::Value* PickleOf(pickle::Graph& graph, const Json& json) {
  if (json.is_object()) {
    std::vector<std::pair<pickle::Value*, pickle::Value*>> entries;
    for (const auto& [key, value] : json.items()) {
      const bool digits = !key.empty() && key.find_first_not_of("0123456789") == std::string::npos;
      entries.emplace_back(digits ? graph.Int(std::stoll(key)) : graph.Str(key),
                           PickleOf(graph, value));
    }
    return graph.Dict(std::move(entries));
  }
  if (json.is_array()) {
    std::vector<pickle::Value*> items;
    for (const Json& item : json) items.push_back(PickleOf(graph, item));
    return graph.List(std::move(items));
  }
  if (json.is_string()) return graph.Str(json.get<std::string>());
  if (json.is_number_float()) return graph.Float(json.get<double>());
  return graph.Int(json.get<int64_t>());
}

// An affine-map entry at TP degree 2: each rank's one piece (shape, source offset, locations) of
// a parameter of `logical` shape.
Json Entry(const std::vector<uint64_t>& logical, const std::vector<uint64_t>& shard,
           const std::vector<int64_t>& offsets, const std::vector<std::vector<int>>& locations) {
  std::vector<uint64_t> strides(logical.size(), 1);
  for (size_t d = logical.size(); d-- > 1;) strides[d - 1] = strides[d] * logical[d];
  std::vector<uint64_t> shard_strides(shard.size(), 1);
  for (size_t d = shard.size(); d-- > 1;) shard_strides[d - 1] = shard_strides[d] * shard[d];
  Json ranks = Json::object();
  for (size_t t = 0; t < offsets.size(); ++t) {
    ranks[std::to_string(t)] = {{"shard_shape", shard},
                                {"pieces",
                                 {{{"shape", shard},
                                   {"source", {offsets[t], strides}},
                                   {"dest", {0, shard_strides}},
                                   {"locations", locations[t]}}}}};
  }
  return {{"logical_shape", logical}, {"ranks", ranks}};
}

class AutoTpMapsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    info_ = {{"universal_checkpoint_version", 0.4},
             {"vocabulary_parameter_patterns", {"^embed\\.weight$"}},
             {"original_vocab_size", 8},
             {"autotp_unsupported_parameter_patterns", Json::object()},
             {"affine_map",
              {{"version", 1},
               {"params",
                {{"^q\\.weight$", Entry({8, 4}, {4, 4}, {0, 16}, {{0}, {1}})},
                 {"^o\\.weight$", Entry({4, 8}, {4, 4}, {0, 4}, {{0}, {1}})},
                 {"^layers\\.\\d+\\.norm\\.weight$", Entry({4}, {4}, {0, 0}, {{0, 1}, {0, 1}})},
                 {"^embed\\.weight$", Entry({8, 4}, {4, 4}, {0, 16}, {{0}, {1}})}}}}}};
  }

  // ReadAutoTpMaps of a model-states file carrying info_, at TP degree `tp`, its affine map first
  // rewritten for `tp` where `rewrite`.
  Result<AutoTpMaps> Read(const std::vector<std::string>& names, uint32_t tp = 2,
                          bool rewrite = false) {
    pickle::Graph graph;
    pickle::Value* info = PickleOf(graph, info_);
    if (rewrite) {
      const Status status =
          SetAffineMapDegree(graph, info->Get("affine_map")->Get("params"), tp, "made.pt");
      if (!status.ok()) return status;
    }
    graph.set_root(graph.Dict({{graph.Str("mp_world_size"), graph.Int(tp)},
                               {graph.Str("universal_checkpoint_info"), info}}));
    const std::string path = dir_.path() + "/model_states.pt";
    Result<TorchArchiveWriter> writer = TorchArchiveWriter::Create(path);
    if (!writer.ok()) return writer.status();
    if (Result<uint64_t> size = writer->Finish(graph.root()); !size.ok()) return size.status();
    Result<TorchArchiveReader> reader = TorchArchiveReader::Open(path);
    if (!reader.ok()) return reader.status();
    EXPECT_TRUE(HasAutoTpMaps(*reader));
    return ReadAutoTpMaps(*reader, tp, names);
  }

  Json& Piece(const std::string& pattern, int rank) {
    return info_["affine_map"]["params"][pattern]["ranks"][std::to_string(rank)]["pieces"][0];
  }

  TempDir dir_;
  Json info_;
};

TEST_F(AutoTpMapsTest, ColumnAndRowSplitsAndWholeParametersAreTheirShardMaps) {
  Result<AutoTpMaps> maps = Read({"q.weight", "o.weight", "layers.3.norm.weight", "embed.weight"});
  ASSERT_TRUE(maps.ok()) << maps.status().ToString();
  EXPECT_EQ(MapJson(maps->maps.at("q.weight")),
            Json::parse(R"({"rule": "split", "dim": 0, "sub_params": [8], "vocab": false,
                            "universal": "none"})"));
  EXPECT_EQ(maps->maps.at("o.weight").rule, Rule::kSplit);
  EXPECT_EQ(maps->maps.at("o.weight").dim, 1u);
  EXPECT_EQ(maps->maps.at("layers.3.norm.weight").rule, Rule::kReplicated);  // by a regex
  EXPECT_EQ(maps->whole_shapes.at("o.weight"), (Shape{4, 8}));
  EXPECT_EQ(maps->vocabulary, (std::set<std::string>{"embed.weight"}));
}

TEST_F(AutoTpMapsTest, LayoutsOtherThanWholeRankBlocksAreRefusedNamingTheField) {
  const auto refusal = [this](const std::string& name) { return Read({name}).status(); };
  const std::string q = "universal_checkpoint_info/affine_map/params/^q\\.weight$/ranks/1";

  Piece("^q\\.weight$", 1)["source"][0] = 17;  // not rank 1's block
  EXPECT_EQ(refusal("q.weight").code(), StatusCode::kUnsupported);
  EXPECT_THAT(refusal("q.weight").message(),
              AllOf(HasSubstr("model_states.pt: " + q), HasSubstr("block of 2 equal ones")));
  SetUp();
  Piece("^q\\.weight$", 1)["scale"] = 0.5;
  EXPECT_THAT(refusal("q.weight").message(), HasSubstr(q + "/pieces/0/scale: a scaled slice"));
  SetUp();
  info_["affine_map"]["params"]["^q\\.weight$"]["ranks"]["1"]["pieces"].push_back(
      Piece("^q\\.weight$", 1));
  EXPECT_THAT(refusal("q.weight").message(), HasSubstr(q + "/pieces: 2 pieces"));
  SetUp();
  // Uneven (AutoTP splits a vocabulary of 67 rows 34 / 33).
  info_["affine_map"]["params"]["^q\\.weight$"] = Entry({7, 4}, {4, 4}, {0, 16}, {{0}, {1}});
  info_["affine_map"]["params"]["^q\\.weight$"]["ranks"]["1"]["shard_shape"] = {3, 4};
  info_["affine_map"]["params"]["^q\\.weight$"]["ranks"]["1"]["pieces"][0]["shape"] = {3, 4};
  EXPECT_EQ(refusal("q.weight").code(), StatusCode::kUnsupported);
  SetUp();
  EXPECT_THAT(refusal("missing.weight").message(),
              HasSubstr("0 entries describe missing.weight, so its TP layout is not known"));
  info_["autotp_unsupported_parameter_patterns"] = {{"^q\\.weight$", "fused"}};
  EXPECT_THAT(refusal("q.weight").message(),
              HasSubstr("autotp_unsupported_parameter_patterns: AutoTP could not describe"));
  SetUp();
  info_["original_vocab_size"] = 7;  // ds_to_universal would cut a row
  EXPECT_THAT(refusal("embed.weight").message(),
              HasSubstr("original_vocab_size: not the rows of embed.weight"));
  SetUp();
  info_["affine_map"]["version"] = 2;
  EXPECT_THAT(refusal("q.weight").message(), HasSubstr("affine_map/version: 2"));
}

TEST_F(AutoTpMapsTest, TheAffineMapRewrittenForAnotherDegreeDescribesTheSameLayoutThere) {
  const std::vector<std::string> names = {"q.weight", "o.weight", "layers.3.norm.weight"};
  Result<AutoTpMaps> at_two = Read(names);
  Result<AutoTpMaps> at_four = Read(names, 4, /*rewrite=*/true);
  ASSERT_TRUE(at_two.ok() && at_four.ok()) << at_four.status().ToString();
  for (const std::string& name : names) {
    EXPECT_EQ(MapJson(at_four->maps.at(name)), MapJson(at_two->maps.at(name))) << name;
    EXPECT_EQ(at_four->whole_shapes.at(name), at_two->whole_shapes.at(name)) << name;
  }
  // 8 rows do not split over 3 ranks: the first entry (the map's keys are in sorted order here).
  EXPECT_THAT(
      Read(names, 3, /*rewrite=*/true).status().message(),
      AllOf(HasSubstr("made.pt: universal_checkpoint_info/affine_map/params/^embed\\.weight$"),
            HasSubstr("does not split evenly over tp=3 along dim 0")));
}

TEST_F(AutoTpMapsTest, MalformedEntriesAreCorruptNamingTheField) {
  info_["affine_map"]["params"]["^o\\.weight$"]["logical_shape"] = "4x8";
  Result<AutoTpMaps> maps = Read({"o.weight"});
  EXPECT_EQ(maps.status().code(), StatusCode::kCorrupt);
  EXPECT_THAT(maps.status().message(),
              HasSubstr("affine_map/params/^o\\.weight$/logical_shape: not a list of sizes"));
  SetUp();
  info_["affine_map"]["params"]["^o\\.weight$"]["ranks"].erase("1");
  EXPECT_THAT(Read({"o.weight"}).status().message(),
              HasSubstr("ranks: not a dict of the 2 TP ranks"));
}

// The blocks of DeepSpeed 0.19.8's get_shard_size_list for the same arguments (a layer named
// "q" or "lm_head" for the grain split, an attention layer for the heads).
TEST(AutoTpSplitRuleTest, TheBlocksAreAutoTpsGrainAndHeadSplits) {
  using Blocks = std::vector<uint64_t>;
  EXPECT_EQ(GrainBlocks(32, 4, 1), (Blocks{8, 8, 8, 8}));
  EXPECT_EQ(GrainBlocks(32, 3, 1), (Blocks{11, 11, 10}));
  EXPECT_EQ(GrainBlocks(67, 2, 1), (Blocks{34, 33}));
  EXPECT_EQ(GrainBlocks(96, 2, 64), (Blocks{64, 32}));
  EXPECT_EQ(GrainBlocks(200, 3, 64), (Blocks{64, 64, 72}));
  EXPECT_EQ(GrainBlocks(256, 8, 64), (Blocks{64, 64, 64, 64, 0, 0, 0, 0}));
  EXPECT_EQ(GrainBlocks(10, 4, 64), (Blocks{3, 3, 2, 2}));
  EXPECT_EQ(HeadBlocks(32, 8, 4), (Blocks{8, 8, 8, 8, 0, 0, 0, 0}));
  EXPECT_EQ(HeadBlocks(48, 4, 6), (Blocks{16, 16, 8, 8}));
  EXPECT_EQ(HeadBlocks(48, 3, 6), (Blocks{16, 16, 16}));
}

TEST(AutoTpSplitRuleTest, AnotherDegreeIsRefusedWhereAutoTpMaySplitUnevenly) {
  const AutoTpSplitRule plain;  // a model without a config, tp_grain_size 1
  EXPECT_TRUE(CheckEvenAtDegree("q.weight", 32, 2, 4, plain).ok());
  EXPECT_TRUE(CheckEvenAtDegree("q.weight", 32, 2, 1, plain).ok());
  EXPECT_THAT(CheckEvenAtDegree("q.weight", 32, 2, 3, plain).message(),
              AllOf(HasSubstr("tp=3: q.weight (32 along its split dimension)"),
                    HasSubstr("blocks of [11, 11, 10] (tp_grain_size 1)")));

  AutoTpSplitRule grain;
  grain.grain = 64;
  EXPECT_TRUE(CheckEvenAtDegree("up.weight", 256, 2, 4, grain).ok());
  EXPECT_THAT(CheckEvenAtDegree("up.weight", 256, 2, 8, grain).message(),
              HasSubstr("[64, 64, 64, 64, 0, 0, 0, 0] (tp_grain_size 64)"));
  // Equal blocks of 48 at tp=2 are not what a grain of 64 gives: not the rule the model ran.
  EXPECT_THAT(CheckEvenAtDegree("up.weight", 96, 2, 1, grain).message(),
              AllOf(HasSubstr("split it at tp=2 into equal blocks, which tp_grain_size 64 do not "
                              "give"),
                    HasSubstr("config.json beside the tag")));

  AutoTpSplitRule heads;
  heads.model_config = true;
  heads.kv_heads = 6;
  heads.kv_heads_from = "/c/config.json: num_key_value_heads";
  EXPECT_TRUE(CheckEvenAtDegree("k.weight", 48, 2, 3, heads).ok());
  // Near even at tp=4 (12 each), but an attention layer takes whole heads: 2, 2, 1, 1.
  EXPECT_THAT(CheckEvenAtDegree("k.weight", 48, 2, 4, heads).message(),
              AllOf(HasSubstr("with 6 key/value heads (/c/config.json: num_key_value_heads)"),
                    HasSubstr("[16, 16, 8, 8]")));
  // The heads do not divide 50: only the grain split applies.
  EXPECT_TRUE(CheckEvenAtDegree("norm.weight", 50, 2, 5, heads).ok());
  heads.kv_heads = 4;
  EXPECT_THAT(CheckEvenAtDegree("k.weight", 32, 2, 8, heads).message(),
              HasSubstr("[8, 8, 8, 8, 0, 0, 0, 0]"));

  AutoTpSplitRule headless;
  headless.model_config = true;
  EXPECT_THAT(CheckEvenAtDegree("q.weight", 32, 2, 4, headless).message(),
              HasSubstr("config.json beside the tag names no key/value head count"));
}

class AutoTpSplitRuleReadTest : public ::testing::Test {
 protected:
  // ReadAutoTpSplitRule of a model states in <dir>/global_step3 whose ds_config has
  // tensor_parallel `section`, beside `config` (none where null) written as <dir>/config.json.
  Result<AutoTpSplitRule> Read(const Json& section, const std::string& config) {
    const std::string tag = dir_.path() + "/global_step3";
    std::filesystem::create_directories(tag);
    pickle::Graph graph;
    graph.set_root(
        graph.Dict({{graph.Str("ds_config"), PickleOf(graph, {{"tensor_parallel", section}})}}));
    const std::string path = tag + "/zero_pp_rank_0_mp_rank_00_model_states.pt";
    Result<TorchArchiveWriter> writer = TorchArchiveWriter::Create(path);
    if (!writer.ok()) return writer.status();
    if (Result<uint64_t> size = writer->Finish(graph.root()); !size.ok()) return size.status();
    std::filesystem::remove(dir_.path() + "/config.json");
    if (!config.empty()) std::ofstream(dir_.path() + "/config.json") << config;
    Result<TorchArchiveReader> reader = TorchArchiveReader::Open(path);
    if (!reader.ok()) return reader.status();
    return ReadAutoTpSplitRule(*reader, tag + "/");
  }

  TempDir dir_;
};

TEST_F(AutoTpSplitRuleReadTest, TheGrainIsTheDsConfigsAndTheHeadsTheConfigJsonsBesideTheTag) {
  Result<AutoTpSplitRule> rule = Read({{"autotp_size", 2}}, "");
  ASSERT_TRUE(rule.ok()) << rule.status().ToString();
  EXPECT_EQ(rule->grain, 1u);
  EXPECT_FALSE(rule->model_config);
  EXPECT_FALSE(rule->kv_heads);

  rule = Read({{"autotp_size", 2}, {"tp_grain_size", 64}},
              R"({"num_attention_heads": 8, "num_key_value_heads": 2})");
  ASSERT_TRUE(rule.ok()) << rule.status().ToString();
  EXPECT_EQ(rule->grain, 64u);
  EXPECT_TRUE(rule->model_config);
  EXPECT_EQ(rule->kv_heads, 2u);
  EXPECT_EQ(rule->kv_heads_from, dir_.path() + "/config.json: num_key_value_heads");

  // GPT-2 keeps num_attention_heads as n_head; a vision-language model its text model's apart.
  rule = Read(Json::object(), R"({"n_head": 12, "n_embd": 768})");
  ASSERT_TRUE(rule.ok()) << rule.status().ToString();
  EXPECT_EQ(rule->kv_heads, 12u);
  rule = Read(Json::object(),
              R"({"num_attention_heads": 16, "text_config": {"num_key_value_heads": 4}})");
  ASSERT_TRUE(rule.ok()) << rule.status().ToString();
  EXPECT_EQ(rule->kv_heads, 4u);
  EXPECT_THAT(rule->kv_heads_from, HasSubstr("text_config/num_key_value_heads"));
  rule = Read(Json::object(), R"({"hidden_size": 64})");
  ASSERT_TRUE(rule.ok()) << rule.status().ToString();
  EXPECT_TRUE(rule->model_config);
  EXPECT_FALSE(rule->kv_heads);
}

TEST_F(AutoTpSplitRuleReadTest, MalformedValuesAreRefusedNamingTheFileAndTheField) {
  EXPECT_THAT(Read({{"tp_grain_size", 0}}, "").status().message(),
              AllOf(HasSubstr("zero_pp_rank_0_mp_rank_00_model_states.pt"),
                    HasSubstr("ds_config/tensor_parallel/tp_grain_size: not a positive int")));
  Result<AutoTpSplitRule> rule = Read(Json::object(), "{\"num_key_value_heads\": ");
  EXPECT_EQ(rule.status().code(), StatusCode::kCorrupt);
  EXPECT_THAT(rule.status().message(), HasSubstr("config.json: not a JSON object"));
  EXPECT_THAT(Read(Json::object(), R"({"num_key_value_heads": "8"})").status().message(),
              HasSubstr("config.json: num_key_value_heads: not a positive int"));
}

}  // namespace
}  // namespace ucp::deepspeed
