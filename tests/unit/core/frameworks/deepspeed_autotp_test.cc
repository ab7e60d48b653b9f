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

// An affine-map entry at TP degree widths[0].size() of a parameter of `logical` shape fused of
// parts along dim 0, as AutoTP's sub_param_map writes it: rank t holds widths[i][t] rows of each
// part i, after those of the ranks before it, its pieces of the parts one after another.
Json FusedEntry(const std::vector<uint64_t>& logical,
                const std::vector<std::vector<uint64_t>>& widths) {
  const uint64_t row = logical.size() > 1 ? logical[1] : 1;
  std::vector<uint64_t> strides =
      logical.size() > 1 ? std::vector<uint64_t>{row, 1} : std::vector<uint64_t>{1};
  Json ranks = Json::object();
  for (size_t t = 0; t < widths[0].size(); ++t) {
    std::vector<uint64_t> shard = logical;
    shard[0] = 0;
    for (const std::vector<uint64_t>& part : widths) shard[0] += part[t];
    Json pieces = Json::array();
    uint64_t part_start = 0;
    uint64_t dest = 0;
    for (const std::vector<uint64_t>& part : widths) {
      uint64_t source = part_start;
      for (size_t r = 0; r < t; ++r) source += part[r];
      std::vector<uint64_t> shape = shard;
      shape[0] = part[t];
      pieces.push_back({{"shape", shape},
                        {"source", {source * row, strides}},
                        {"dest", {dest * row, strides}},
                        {"locations", {t}}});
      dest += part[t];
      for (const uint64_t width : part) part_start += width;
    }
    ranks[std::to_string(t)] = {{"shard_shape", shard}, {"pieces", pieces}};
  }
  return {{"logical_shape", logical}, {"ranks", ranks}};
}

// The atom's element runs of TP rank t's local elements [begin, end) (MapLocalRange), in order.
std::vector<FlatRange> AtomRuns(const ShardMap& map, const Geometry& geometry, uint32_t t,
                                uint64_t begin, uint64_t end) {
  Result<std::vector<GlobalRun>> runs = MapLocalRange(map, geometry, t, begin, end);
  EXPECT_TRUE(runs.ok()) << runs.status().ToString();
  std::vector<FlatRange> out;
  for (const GlobalRun& run : runs.ok() ? *runs : std::vector<GlobalRun>{}) {
    EXPECT_TRUE(run.region);
    if (!run.region) continue;
    for (const FlatRange& range : run.region->Runs()) out.push_back(range);
  }
  return out;
}

// The (source, dest) offsets of the pieces of TP rank t's slice in affine-map entry `entry`.
std::vector<std::pair<int64_t, int64_t>> PieceOffsets(const pickle::Value* entry, size_t t) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const pickle::Value* piece :
       entry->Get("ranks")->entries().at(t).second->Get("pieces")->items()) {
    out.emplace_back(*piece->Get("source")->items()[0]->AsInt64(),
                     *piece->Get("dest")->items()[0]->AsInt64());
  }
  return out;
}

// The first entry of a model states' universal_checkpoint_info/sub_param_shard_widths.
std::vector<std::vector<int64_t>> FirstShardWidths(const pickle::Value* root) {
  std::vector<std::vector<int64_t>> out;
  for (const pickle::Value* part : root->Get("universal_checkpoint_info")
                                       ->Get("sub_param_shard_widths")
                                       ->entries()[0]
                                       .second->items()) {
    out.emplace_back();
    for (const pickle::Value* width : part->items()) out.back().push_back(*width->AsInt64());
  }
  return out;
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

  // A model-states file of TP degree 2 carrying info_, written to the test's folder.
  Result<TorchArchiveReader> ModelStates() {
    pickle::Graph graph;
    graph.set_root(graph.Dict({{graph.Str("mp_world_size"), graph.Int(2)},
                               {graph.Str("universal_checkpoint_info"), PickleOf(graph, info_)}}));
    const std::string path = dir_.path() + "/fused_model_states.pt";
    Result<TorchArchiveWriter> writer = TorchArchiveWriter::Create(path);
    if (!writer.ok()) return writer.status();
    if (Result<uint64_t> size = writer->Finish(graph.root()); !size.ok()) return size.status();
    return TorchArchiveReader::Open(path);
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
              AllOf(HasSubstr("model_states.pt: " + q),
                    HasSubstr("not rank 1's block along one dimension, after those of the ranks "
                              "before it")));
  SetUp();
  Piece("^q\\.weight$", 1)["scale"] = 0.5;
  EXPECT_THAT(refusal("q.weight").message(), HasSubstr(q + "/pieces/0/scale: a scaled slice"));
  SetUp();
  info_["affine_map"]["params"]["^q\\.weight$"]["ranks"]["1"]["pieces"].push_back(
      Piece("^q\\.weight$", 1));
  EXPECT_THAT(refusal("q.weight").message(), HasSubstr(q + ": another layout than rank 0's"));
  SetUp();
  // Blocks of 4 and 4 of 7 rows; an empty block.
  info_["affine_map"]["params"]["^q\\.weight$"] = Entry({7, 4}, {4, 4}, {0, 16}, {{0}, {1}});
  EXPECT_THAT(refusal("q.weight").message(),
              HasSubstr("ranks: blocks [4, 4] do not make dim 0 of logical_shape [7, 4]"));
  info_["affine_map"]["params"]["^q\\.weight$"]["ranks"]["1"]["shard_shape"] = {0, 4};
  info_["affine_map"]["params"]["^q\\.weight$"]["ranks"]["1"]["pieces"][0]["shape"] = {0, 4};
  EXPECT_THAT(refusal("q.weight").message(), HasSubstr("not rank 1's block"));
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

TEST_F(AutoTpMapsTest, UnevenBlocksAreASplitThatKeepsThemAndIsRewrittenInTheBlocksGiven) {
  // up: 5 rows as 3 and 2 (rank 1's block starts at row 3, element 12).
  Json up = Entry({5, 4}, {3, 4}, {0, 12}, {{0}, {1}});
  up["ranks"]["1"]["shard_shape"] = {2, 4};
  up["ranks"]["1"]["pieces"][0]["shape"] = {2, 4};
  info_["affine_map"]["params"]["^up\\.weight$"] = up;
  Result<AutoTpMaps> maps = Read({"up.weight", "q.weight"});
  ASSERT_TRUE(maps.ok()) << maps.status().ToString();
  const ShardMap& map = maps->maps.at("up.weight");
  EXPECT_EQ(map.blocks, (std::vector<uint64_t>{3, 2}));
  EXPECT_TRUE(maps->maps.at("q.weight").blocks.empty());  // equal blocks
  Result<ShardMap> back = MapFromJson("up.weight", MapJson(map));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->blocks, map.blocks);

  // The geometry: rank 1 holds rows 3 and 4.
  Result<Geometry> geometry = GeometryAt("up.weight", map, {5, 4}, 2, std::nullopt, map.blocks);
  ASSERT_TRUE(geometry.ok()) << geometry.status().ToString();
  EXPECT_EQ(LocalShape(*geometry, 0), (Shape{3, 4}));
  EXPECT_EQ(LocalShape(*geometry, 1), (Shape{2, 4}));
  Result<std::vector<GlobalRun>> runs = MapLocalRange(map, *geometry, 1, 0, 8);
  ASSERT_TRUE(runs.ok() && runs->size() == 1 && runs->front().region) << runs.status().ToString();
  EXPECT_EQ(runs->front().region->Runs(), (std::vector<FlatRange>{{12, 20}}));
  EXPECT_EQ(GeometryAt("up.weight", map, {5, 4}, 2, std::nullopt, {5, 0}).status().code(),
            StatusCode::kCorrupt);

  // Rewritten at tp=3 in blocks 2, 2, 1 (the parameters without blocks split evenly or not at
  // all there: the others are left out).
  info_["affine_map"]["params"].erase("^embed\\.weight$");
  info_["affine_map"]["params"].erase("^q\\.weight$");
  info_["affine_map"]["params"].erase("^o\\.weight$");
  pickle::Graph graph;
  pickle::Value* info = PickleOf(graph, info_);
  ASSERT_TRUE(SetAffineMapDegree(graph, info->Get("affine_map")->Get("params"), 3, "made.pt",
                                 {{"up.weight", {2, 2, 1}}})
                  .ok());
  const pickle::Value* ranks =
      info->Get("affine_map")->Get("params")->Get("^up\\.weight$")->Get("ranks");
  ASSERT_NE(ranks, nullptr);
  std::vector<int64_t> offsets;
  for (const auto& [rank, value] : ranks->entries()) {
    offsets.push_back(*value->Get("pieces")->items()[0]->Get("source")->items()[0]->AsInt64());
  }
  EXPECT_EQ(offsets, (std::vector<int64_t>{0, 8, 16}));
  EXPECT_THAT(SetAffineMapDegree(graph, info->Get("affine_map")->Get("params"), 3, "made.pt",
                                 {{"up.weight", {2, 2}}})
                  .message(),
              HasSubstr("^up\\.weight$: logical_shape [5, 4] does not split evenly over tp=3 "
                        "along dim 0, nor by blocks given for it"));
}

// A fused parameter (q, k and v of 8, 4 and 4 rows) is a split of those sub-parameters, each in
// equal blocks, as Megatron's fused QKV is; rewritten at another degree it is the same split
// there, and so is AutoTP's record of its widths. Pieces out of their place are refused naming the
// field.
TEST_F(AutoTpMapsTest, FusedPartsAreSubParametersAtEveryDegree) {
  info_["affine_map"]["params"]["^qkv\\.weight$"] = FusedEntry({16, 4}, {{4, 4}, {2, 2}, {2, 2}});
  info_["sub_param_shard_widths"] = {{"^qkv\\.weight$", {{4, 4}, {2, 2}, {2, 2}}}};
  Result<AutoTpMaps> maps = Read({"qkv.weight"});
  ASSERT_TRUE(maps.ok()) << maps.status().ToString();
  const ShardMap& map = maps->maps.at("qkv.weight");
  EXPECT_EQ(MapJson(map), Json::parse(R"({"rule": "split", "dim": 0, "sub_params": [8, 4, 4],
                                          "vocab": false, "universal": "none"})"));
  // Rank 1's 8 rows: q's rows 4..7, k's 10..11 and v's 14..15, 4 elements a row.
  Result<Geometry> geometry = GeometryAt("qkv.weight", map, {16, 4}, 2, std::nullopt);
  ASSERT_TRUE(geometry.ok()) << geometry.status().ToString();
  EXPECT_EQ(AtomRuns(map, *geometry, 1, 0, 32),
            (std::vector<FlatRange>{{16, 32}, {40, 48}, {56, 64}}));

  // At tp=4: rank 1 takes q's rows 2..3, k's 9 and v's 13, in one slice of 4 rows.
  Result<AutoTpMaps> at_four = Read({"qkv.weight"}, 4, /*rewrite=*/true);
  ASSERT_TRUE(at_four.ok()) << at_four.status().ToString();
  EXPECT_EQ(MapJson(at_four->maps.at("qkv.weight")), MapJson(map));
  pickle::Graph graph;
  pickle::Value* info = PickleOf(graph, info_);
  ASSERT_TRUE(SetAffineMapDegree(graph, info->Get("affine_map")->Get("params"), 4, "made.pt").ok());
  EXPECT_EQ(PieceOffsets(info->Get("affine_map")->Get("params")->Get("^qkv\\.weight$"), 1),
            (std::vector<std::pair<int64_t, int64_t>>{{8, 0}, {36, 8}, {52, 12}}));

  // The model states' record at tp=4: sub_param_shard_widths too.
  Result<TorchArchiveReader> reader = ModelStates();
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  pickle::Graph resaved;
  pickle::Value* root = resaved.Import(reader->root());
  const Status set = SetTpDegree(resaved, root, 4, *reader, {});
  ASSERT_TRUE(set.ok()) << set.ToString();
  EXPECT_EQ(FirstShardWidths(root),
            (std::vector<std::vector<int64_t>>{{2, 2, 2, 2}, {1, 1, 1, 1}, {1, 1, 1, 1}}));
  const Json fused_only = {{"^qkv\\.weight$", info_["affine_map"]["params"]["^qkv\\.weight$"]}};
  EXPECT_THAT(SetAffineMapDegree(graph, PickleOf(graph, fused_only), 3, "made.pt").message(),
              HasSubstr("made.pt: universal_checkpoint_info/affine_map/params/^qkv\\.weight$: "
                        "logical_shape [16, 4], a sub-parameter of 8, does not split evenly over "
                        "tp=3 along dim 0"));

  const std::string field = "universal_checkpoint_info/affine_map/params/^qkv\\.weight$/ranks";
  info_["affine_map"]["params"]["^qkv\\.weight$"] = FusedEntry({16, 4}, {{4, 4}, {2, 2}, {2, 2}});
  std::swap(info_["affine_map"]["params"]["^qkv\\.weight$"]["ranks"]["1"]["pieces"][1]["source"],
            info_["affine_map"]["params"]["^qkv\\.weight$"]["ranks"]["1"]["pieces"][2]["source"]);
  EXPECT_THAT(Read({"qkv.weight"}).status().message(),
              HasSubstr(field + "/1: piece 1 at source offset 56 is not rank 1's block along one "
                                "dimension, after those of the ranks before it"));
}

// Parts split unevenly (q's 9 rows as 5 and 4, as AutoTP's grain rule splits them) keep their
// blocks part by part: rank 1 holds q's rows 5..8, then k's and v's halves. AutoTP's rule at
// another degree splits each part, and the affine map and sub_param_shard_widths rewritten there
// in the blocks given take them.
TEST_F(AutoTpMapsTest, FusedPartsSplitUnevenlyKeepTheirBlocksPartByPart) {
  info_["affine_map"]["params"]["^qkv\\.weight$"] = FusedEntry({17, 4}, {{5, 4}, {2, 2}, {2, 2}});
  info_["sub_param_shard_widths"] = {{"^qkv\\.weight$", {{5, 4}, {2, 2}, {2, 2}}}};
  Result<AutoTpMaps> maps = Read({"qkv.weight"});
  ASSERT_TRUE(maps.ok()) << maps.status().ToString();
  const ShardMap& map = maps->maps.at("qkv.weight");
  EXPECT_EQ(map.sub_params, (std::vector<uint64_t>{9, 4, 4}));
  EXPECT_EQ(map.blocks, (std::vector<uint64_t>{5, 4, 2, 2, 2, 2}));
  Result<ShardMap> back = MapFromJson("qkv.weight", MapJson(map));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->blocks, map.blocks);
  Json bad = MapJson(map);
  bad["blocks"] = {5, 4, 2, 2, 1, 3, 0};  // not 2 extents of each part
  EXPECT_EQ(MapFromJson("qkv.weight", bad).status().code(), StatusCode::kCorrupt);

  Result<Geometry> geometry = GeometryAt("qkv.weight", map, {17, 4}, 2, std::nullopt, map.blocks);
  ASSERT_TRUE(geometry.ok()) << geometry.status().ToString();
  EXPECT_EQ(LocalShape(*geometry, 0), (Shape{9, 4}));
  EXPECT_EQ(LocalShape(*geometry, 1), (Shape{8, 4}));
  EXPECT_EQ(AtomRuns(map, *geometry, 1, 0, 32),
            (std::vector<FlatRange>{{20, 36}, {44, 52}, {60, 68}}));
  EXPECT_EQ(GeometryAt("qkv.weight", map, {17, 4}, 2, std::nullopt, {5, 4, 2, 2}).status().code(),
            StatusCode::kCorrupt);

  // AutoTP's grain rule splits each part near evenly: at tp=4 q's 9 as 3, 2, 2, 2, k's and v's 4
  // as 1 each; at tp=3 q's as 3 each, k's and v's as 2, 1, 1.
  Result<std::vector<uint64_t>> at_four = MapBlocksAtDegree("qkv.weight", *geometry, 4, {});
  ASSERT_TRUE(at_four.ok()) << at_four.status().ToString();
  EXPECT_EQ(*at_four, (std::vector<uint64_t>{3, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1}));
  Result<std::vector<uint64_t>> at_three = MapBlocksAtDegree("qkv.weight", *geometry, 3, {});
  ASSERT_TRUE(at_three.ok()) << at_three.status().ToString();
  EXPECT_EQ(*at_three, (std::vector<uint64_t>{3, 3, 3, 2, 1, 1, 2, 1, 1}));
  AutoTpSplitRule headless;
  headless.model_config = true;  // a config.json without a head count
  EXPECT_THAT(MapBlocksAtDegree("qkv.weight", *geometry, 4, headless).status().message(),
              HasSubstr("qkv.weight (sub-parameter 0) (9 along its split dimension)"));

  // At tp=3 in those blocks: rank 1 takes q's rows 3..5, k's 11 and v's 15.
  Result<TorchArchiveReader> reader = ModelStates();
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  pickle::Graph resaved;
  pickle::Value* root = resaved.Import(reader->root());
  pickle::Value* params = root->Get("universal_checkpoint_info")->Get("affine_map")->Get("params");
  for (const char* other : {"^q\\.weight$", "^o\\.weight$", "^embed\\.weight$"}) {
    std::erase_if(params->mutable_entries(), [&](const auto& entry) {
      return entry.first->data() == other;  // 8 or 4 rows of one part: not over 3 ranks
    });
  }
  const Status set =
      SetTpDegree(resaved, root, 3, *reader, {{"qkv.weight", {3, 3, 3, 2, 1, 1, 2, 1, 1}}});
  ASSERT_TRUE(set.ok()) << set.ToString();
  EXPECT_EQ(PieceOffsets(params->Get("^qkv\\.weight$"), 1),
            (std::vector<std::pair<int64_t, int64_t>>{{12, 0}, {44, 12}, {60, 16}}));
  EXPECT_EQ(FirstShardWidths(root),
            (std::vector<std::vector<int64_t>>{{3, 3, 3}, {2, 1, 1}, {2, 1, 1}}));
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
  EXPECT_EQ(GrainBlocks(32, 0, 1), Blocks{});
  EXPECT_EQ(GrainBlocks(32, 2, 0), (Blocks{0, 0}));
  EXPECT_EQ(HeadBlocks(32, 2, 0), (Blocks{0, 0}));
}

TEST(AutoTpSplitRuleTest, TheBlocksAtAnotherDegreeAreThoseOfTheWayTheSavedBlocksShow) {
  using Blocks = std::vector<uint64_t>;
  const auto blocks = [](uint64_t total, const Blocks& saved, uint32_t to,
                         const AutoTpSplitRule& rule) {
    Result<Blocks> out = BlocksAtDegree("w", total, saved, to, rule);
    return out.ok() ? *out : Blocks{};
  };
  const auto refusal = [](uint64_t total, const Blocks& saved, uint32_t to,
                          const AutoTpSplitRule& rule) {
    return std::string(BlocksAtDegree("w", total, saved, to, rule).status().message());
  };
  const AutoTpSplitRule plain;  // a model without a config, tp_grain_size 1: near even
  EXPECT_EQ(blocks(32, {16, 16}, 4, plain), (Blocks{8, 8, 8, 8}));
  EXPECT_EQ(blocks(32, {16, 16}, 3, plain), (Blocks{11, 11, 10}));
  EXPECT_EQ(blocks(65, {33, 32}, 4, plain), (Blocks{17, 16, 16, 16}));
  EXPECT_EQ(blocks(65, {33, 32}, 1, plain), (Blocks{65}));
  EXPECT_THAT(refusal(65, {32, 33}, 4, plain),
              AllOf(HasSubstr("tp=4: w (65 along its split dimension)"),
                    HasSubstr("split it at tp=2 into blocks of [32, 33], which tp_grain_size 1 do "
                              "not give"),
                    HasSubstr("config.json beside the tag")));
  EXPECT_THAT(refusal(2, {1, 1}, 4, plain),
              HasSubstr("blocks of [1, 1, 0, 0] (tp_grain_size 1); ucp writes no empty slices"));

  AutoTpSplitRule grain;
  grain.grain = 64;
  EXPECT_EQ(blocks(200, {128, 72}, 3, grain), (Blocks{64, 64, 72}));
  EXPECT_EQ(blocks(256, {128, 128}, 4, grain), (Blocks{64, 64, 64, 64}));
  EXPECT_THAT(refusal(96, {48, 48}, 1, grain), HasSubstr("which tp_grain_size 64 do not give"));

  AutoTpSplitRule heads;
  heads.model_config = true;
  heads.kv_heads = 6;
  heads.kv_heads_from = "/c/config.json: num_key_value_heads";
  // 24 and 24 at tp=2 are either way's; at tp=3 both give 16 each, at tp=4 they differ.
  EXPECT_EQ(blocks(48, {24, 24}, 3, heads), (Blocks{16, 16, 16}));
  EXPECT_THAT(refusal(48, {24, 24}, 4, heads),
              AllOf(HasSubstr("blocks of [12, 12, 12, 12] (tp_grain_size 1) or, if it is an "
                              "attention layer, of [16, 16, 8, 8] (6 key/value heads "
                              "(/c/config.json: num_key_value_heads))"),
                    HasSubstr("the checkpoint does not say which")));
  // Whole heads at tp=4 (an attention layer), near even at tp=4 (an MLP's).
  EXPECT_EQ(blocks(48, {16, 16, 8, 8}, 5, heads), (Blocks{16, 8, 8, 8, 8}));
  EXPECT_EQ(blocks(48, {12, 12, 12, 12}, 5, heads), (Blocks{10, 10, 10, 9, 9}));
  // The heads do not divide 50: only the grain split applies.
  EXPECT_EQ(blocks(50, {25, 25}, 3, heads), (Blocks{17, 17, 16}));
  heads.kv_heads = 4;
  EXPECT_THAT(refusal(32, {8, 8, 8, 8}, 8, heads),
              HasSubstr("[8, 8, 8, 8, 0, 0, 0, 0] (4 key/value heads"));

  AutoTpSplitRule headless;
  headless.model_config = true;
  EXPECT_THAT(refusal(32, {16, 16}, 4, headless),
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
