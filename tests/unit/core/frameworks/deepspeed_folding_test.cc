// DeepSpeed 0.19's folded AutoEP + AutoTP grid: the ranks writing each expert file as DeepSpeed
// 0.19.8's saves hold them, and the grid read from the model states, with every inconsistent or
// unfolded record refused naming the file and the field.
#include "core/frameworks/deepspeed/folding.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/format/pickle_value.h"
#include "core/format/torch_archive_writer.h"
#include "core/frameworks/deepspeed/common.h"
#include "tests/unit/core/frameworks/deepspeed_testing.h"

namespace ucp::deepspeed {
namespace {

using deepspeed_testing::TempDir;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// The expert files of train_autoep.py --tp T --ep E saves at 4 ranks (2 MoE layers of 4 experts):
// T2E2 lists experts 0-1 under mp_rank_00 and 2-3 under mp_rank_01, each written by two ranks;
// T2E4 experts 0 and 2 under mp_rank_00, 1 and 3 under mp_rank_01 (ranks 2 and 3, of dense rank
// 1, write them); T4E2 experts 0-1 under mp_rank_00 and mp_rank_02, 2-3 under 01 and 03.
TEST(FoldedGridTest, ExpertWritersAreTheRanksOfDenseRankBelowEOfTheirLaneAndExpertRank) {
  const FoldedGrid t2e2{4, 2, 2};
  EXPECT_THAT(t2e2.ExpertWriters(0, 0), ElementsAre(0, 2));
  EXPECT_THAT(t2e2.ExpertWriters(1, 1), ElementsAre(1, 3));
  EXPECT_THAT(t2e2.ExpertWriters(0, 1), IsEmpty());
  EXPECT_THAT(t2e2.ExpertWriters(1, 0), IsEmpty());
  EXPECT_EQ(t2e2.DenseDp(), 2u);
  EXPECT_EQ(t2e2.ExpertDp(), 2u);

  const FoldedGrid t2e4{4, 2, 4};
  EXPECT_THAT(t2e4.ExpertWriters(0, 0), ElementsAre(0));
  EXPECT_THAT(t2e4.ExpertWriters(1, 1), ElementsAre(1));
  EXPECT_THAT(t2e4.ExpertWriters(0, 2), ElementsAre(2));
  EXPECT_THAT(t2e4.ExpertWriters(1, 3), ElementsAre(3));
  EXPECT_THAT(t2e4.ExpertWriters(1, 2), IsEmpty());

  const FoldedGrid t4e2{4, 4, 2};
  for (uint32_t t = 0; t < 4; ++t) {
    EXPECT_THAT(t4e2.ExpertWriters(t, t % 2), ElementsAre(t));
    EXPECT_THAT(t4e2.ExpertWriters(t, 1 - t % 2), IsEmpty());
  }
  EXPECT_EQ(t4e2.DenseDp(), 1u);
  EXPECT_EQ(t4e2.ExpertDp(), 2u);
}

// At a dense data-parallel size of E or more, ranks of dense rank E and above write no expert.
TEST(FoldedGridTest, RanksOfDenseRankEOrAboveWriteNoExpertFile) {
  const FoldedGrid grid{8, 2, 2};  // dense DP 4
  EXPECT_THAT(grid.ExpertWriters(0, 0), ElementsAre(0, 2));
  EXPECT_FALSE(grid.WritesExperts(4));
  EXPECT_EQ(grid.Rank(3, 1), 7u);
  EXPECT_EQ(grid.ExpertDpRank(7), 3u);
}

// In use_data_before_expert_parallelism's order (native MoE over an mpu's TP) runs of W/E ranks
// are one expert-parallel rank's, whatever their lanes (deepspeed/utils/groups.py).
TEST(FoldedGridTest, DataBeforeExpertRunsOfWOverERanksAreOneExpertRank) {
  const FoldedGrid grid{8, 2, 2, true};  // dense DP 4, runs of 4 ranks
  EXPECT_THAT((std::vector<uint32_t>{grid.ExpertRank(0), grid.ExpertRank(3), grid.ExpertRank(4),
                                     grid.ExpertRank(7)}),
              ElementsAre(0, 0, 1, 1));
  EXPECT_THAT(
      (std::vector<uint32_t>{grid.ExpertDpRank(0), grid.ExpertDpRank(3), grid.ExpertDpRank(5)}),
      ElementsAre(0, 3, 1));
  EXPECT_THAT(grid.ExpertHolders(1, 1), ElementsAre(5, 7));
  EXPECT_THAT(grid.ExpertHolders(0, 0), ElementsAre(0, 2));
  EXPECT_EQ(grid.Order().Rank(1, 0), 4u);

  const FoldedGrid default_order{8, 2, 2};
  EXPECT_THAT(default_order.ExpertHolders(1, 1), ElementsAre(1, 3, 5, 7));
  EXPECT_THAT(default_order.ExpertHolders(0, 1), IsEmpty());
}

// With expert tensor parallelism the expert groups lie within each TP lane's dense-data-parallel
// group: _get_expert_parallel_ranks' own example (world 16, TP 2, E 4): expert-parallel groups
// [0,2,4,6], [8,10,12,14], [1,3,5,7], [9,11,13,15]; expert-data-parallel groups [0,8], [2,10], ...
TEST(FoldedGridTest, ExpertTensorParallelismOrdersEachLanesDenseRanks) {
  const FoldedGrid grid{16, 2, 4, false, true};
  EXPECT_EQ(grid.ExpertDp(), 2u);
  EXPECT_THAT((std::vector<uint32_t>{grid.ExpertRank(0), grid.ExpertRank(2), grid.ExpertRank(6),
                                     grid.ExpertRank(8), grid.ExpertRank(3), grid.ExpertRank(9)}),
              ElementsAre(0, 1, 3, 0, 1, 0));
  EXPECT_THAT(
      (std::vector<uint32_t>{grid.ExpertDpRank(2), grid.ExpertDpRank(10), grid.ExpertDpRank(11)}),
      ElementsAre(0, 1, 1));
  EXPECT_EQ(grid.ExpertMember(1, 1, 0), 10u);
  EXPECT_EQ(grid.ExpertMember(1, 1, 1), 11u);
  EXPECT_THAT(grid.ExpertHolders(1, 1), ElementsAre(3, 11));

  // use_data_before_expert_parallelism's order, over a lane's 8 dense ranks at E 4: runs of 2.
  const FoldedGrid data_before{16, 2, 4, true, true};
  EXPECT_THAT((std::vector<uint32_t>{data_before.ExpertRank(2), data_before.ExpertRank(4),
                                     data_before.ExpertDpRank(2), data_before.ExpertDpRank(4)}),
              ElementsAre(0, 1, 1, 0));
  EXPECT_EQ(data_before.ExpertMember(3, 1, 1), 15u);
}

class ReadFoldedGridTest : public ::testing::Test {
 protected:
  struct Record {
    int64_t tp = 2;
    int64_t pp = 1;
    int64_t mp = 2;
    int64_t dp = 2;
    int64_t folded_tp = 2;
    int64_t ep = 2;
    int64_t etp = 1;
    bool autoep = true;
  };

  Result<std::optional<FoldedGrid>> Read(const Record& r) {
    pickle::Graph graph;
    std::vector<std::pair<pickle::Value*, pickle::Value*>> entries = {
        {graph.Str("dp_world_size"), graph.Int(r.dp)},
        {graph.Str("mp_world_size"), graph.Int(r.mp)},
        {graph.Str("checkpoint_parallel_dimensions"),
         graph.Dict({{graph.Str("pp_degree"), graph.Int(r.pp)},
                     {graph.Str("tp_degree"), graph.Int(r.tp)}})},
        {graph.Str("folding"), graph.Dict({{graph.Str("version"), graph.Int(1)},
                                           {graph.Str("tp_size"), graph.Int(r.folded_tp)},
                                           {graph.Str("ep_size"), graph.Int(r.ep)},
                                           {graph.Str("etp_size"), graph.Int(r.etp)}})}};
    if (r.autoep) entries.push_back({graph.Str("ds_autoep_layers"), graph.List({})});
    graph.set_root(graph.Dict(std::move(entries)));
    path_ = dir_.path() + "/mp_rank_00_model_states.pt";
    Result<TorchArchiveWriter> writer = TorchArchiveWriter::Create(path_);
    if (!writer.ok()) return writer.status();
    if (Result<uint64_t> size = writer->Finish(graph.root()); !size.ok()) return size.status();
    Result<TorchArchiveReader> reader = TorchArchiveReader::Open(path_);
    if (!reader.ok()) return reader.status();
    return ReadFoldedGrid(*reader);
  }

  TempDir dir_;
  std::string path_;
};

TEST_F(ReadFoldedGridTest, AFoldedSaveGivesItsWorldTpAndEp) {
  Result<std::optional<FoldedGrid>> grid = Read({.dp = 2, .ep = 4});
  ASSERT_TRUE(grid.ok()) << grid.status().ToString();
  ASSERT_TRUE(grid->has_value());
  EXPECT_EQ((*grid)->world, 4u);
  EXPECT_EQ((*grid)->tp, 2u);
  EXPECT_EQ((*grid)->ep, 4u);
}

TEST_F(ReadFoldedGridTest, TpOneOrNoAutoEpLayersIsNoFoldedSave) {
  Result<std::optional<FoldedGrid>> tp1 = Read({.tp = 1, .mp = 1});
  ASSERT_TRUE(tp1.ok()) << tp1.status().ToString();
  EXPECT_FALSE(tp1->has_value());
  Result<std::optional<FoldedGrid>> native = Read({.autoep = false});
  ASSERT_TRUE(native.ok()) << native.status().ToString();
  EXPECT_FALSE(native->has_value());
}

TEST_F(ReadFoldedGridTest, WhatDeepSpeedDoesNotFoldIsRefusedNamingTheField) {
  const auto refusal = [&](const Record& record) {
    Result<std::optional<FoldedGrid>> grid = Read(record);
    return grid.ok() ? std::string("read") : grid.status().ToString();
  };
  EXPECT_THAT(refusal({.pp = 2}),
              AllOf(HasSubstr("mp_rank_00_model_states.pt"),
                    HasSubstr("checkpoint_parallel_dimensions/pp_degree 2: AutoEP with AutoTP "
                              "in a pipeline")));
  EXPECT_THAT(refusal({.etp = 2}),
              HasSubstr("folding/etp_size 2: expert tensor parallelism is not supported"));
  EXPECT_THAT(refusal({.ep = 1}), HasSubstr("folding/ep_size: 1: not an expert-parallel size"));
  EXPECT_THAT(refusal({.ep = 3}), HasSubstr("folding/ep_size: 3: not an expert-parallel size "
                                            "above 1 dividing the 4 ranks"));
  EXPECT_THAT(refusal({.folded_tp = 4}), HasSubstr("folding/tp_size: 4, but tp_degree is 2"));
  EXPECT_THAT(refusal({.mp = 1}), HasSubstr("mp_world_size: 1, but tp_degree is 2"));
}

// A folding dict written as DeepSpeed writes an optimizer file's (tp rank 1, ep rank 1, dense rank
// 0 of a T2E2 save at 4 ranks), and CheckFolding of it as each file kind.
class CheckFoldingTest : public ::testing::Test {
 protected:
  Result<TorchArchiveReader> Write() {
    pickle::Graph graph;
    graph.set_root(
        graph.Dict({{graph.Str("folding"),
                     graph.Dict({{graph.Str("version"), graph.Int(1)},
                                 {graph.Str("tp_size"), graph.Int(2)},
                                 {graph.Str("tp_rank"), graph.Int(1)},
                                 {graph.Str("ep_size"), graph.Int(2)},
                                 {graph.Str("ep_rank"), graph.Int(1)},
                                 {graph.Str("zero_partition_rank"), graph.Int(0)},
                                 {graph.Str("family"), graph.Str(std::string(kZeroFamily))}})}}));
    const std::string path = dir_.path() + "/zero_pp_rank_0_mp_rank_01_optim_states.pt";
    Result<TorchArchiveWriter> writer = TorchArchiveWriter::Create(path);
    if (!writer.ok()) return writer.status();
    if (Result<uint64_t> size = writer->Finish(graph.root()); !size.ok()) return size.status();
    return TorchArchiveReader::Open(path);
  }

  TempDir dir_;
  const FoldedGrid grid_{4, 2, 2};
};

TEST_F(CheckFoldingTest, TheWritersRanksAndFamilyPass) {
  Result<TorchArchiveReader> reader = Write();
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  const Status status = CheckFolding(*reader, kZeroFamily, grid_, 1, 1, 0);
  EXPECT_TRUE(status.ok()) << status.ToString();
  // An expert file's zero_partition_rank races between its writers: not checked when not given.
  EXPECT_TRUE(CheckFolding(*reader, kZeroFamily, grid_, 1, 1, std::nullopt).ok());
}

TEST_F(CheckFoldingTest, AnotherRanksOrSavesDictIsRefusedNamingTheField) {
  Result<TorchArchiveReader> reader = Write();
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  const auto refusal = [&](std::string_view family, const FoldedGrid& grid, uint32_t tp_rank,
                           uint32_t ep_rank, std::optional<uint32_t> zero_rank) {
    const Status status = CheckFolding(*reader, family, grid, tp_rank, ep_rank, zero_rank);
    return status.ok() ? std::string("passed") : status.ToString();
  };
  EXPECT_THAT(refusal(kZeroFamily, grid_, 0, 1, 0),
              AllOf(HasSubstr("zero_pp_rank_0_mp_rank_01_optim_states.pt"),
                    HasSubstr("folding/tp_rank: 1, expected 0")));
  EXPECT_THAT(refusal(kZeroFamily, grid_, 1, 0, 0), HasSubstr("folding/ep_rank: 1, expected 0"));
  EXPECT_THAT(refusal(kZeroFamily, grid_, 1, 1, 1),
              HasSubstr("folding/zero_partition_rank: 0, expected 1"));
  EXPECT_THAT(refusal(kZeroFamily, FoldedGrid{8, 4, 2}, 1, 1, 0),
              HasSubstr("folding/tp_size: 2, expected 4"));
  EXPECT_THAT(refusal(kExpertFamily, grid_, 1, 1, 0),
              HasSubstr("folding/family: \"zero_optimizer_state\", expected \"routed_expert\""));
}

// An optimizer file's folding dict as DeepSpeed writes it on rank 3 of a T2E2 save at 4 ranks
// (dense rank 1, expert-parallel rank 1, expert DP rank 1), with one dense and one expert entry
// in param_families, set by SetFolding for another grid's rank and read back.
class SetFoldingTest : public ::testing::Test {
 protected:
  static pickle::Value* Family(pickle::Graph& graph, const char* family, const char* group,
                               int64_t rank, int64_t count) {
    return graph.Dict({{graph.Str("family"), graph.Str(family)},
                       {graph.Str("zero_partition_group"), graph.Str(group)},
                       {graph.Str("zero_partition_rank"), graph.Int(rank)},
                       {graph.Str("zero_partition_count"), graph.Int(count)}});
  }

  Result<std::string> Write(const char* dense_group) {
    pickle::Graph graph;
    graph.set_root(graph.Dict(
        {{graph.Str("folding"),
          graph.Dict(
              {{graph.Str("version"), graph.Int(1)},
               {graph.Str("tp_size"), graph.Int(2)},
               {graph.Str("tp_rank"), graph.Int(1)},
               {graph.Str("ep_size"), graph.Int(2)},
               {graph.Str("ep_rank"), graph.Int(1)},
               {graph.Str("zero_partition_group"), graph.Str("per_family")},
               {graph.Str("zero_partition_rank"), graph.Int(1)},
               {graph.Str("zero_partition_count"), graph.Int(2)},
               {graph.Str("family"), graph.Str(std::string(kZeroFamily))},
               {graph.Str("param_families"),
                graph.Dict({{graph.Str("q.weight"), Family(graph, "dense", dense_group, 1, 2)},
                            {graph.Str("experts.w1"),
                             Family(graph, "routed_expert", "edp", 1, 2)}})}})}}));
    const std::string path = dir_.path() + "/zero_pp_rank_1_mp_rank_01_optim_states.pt";
    Result<TorchArchiveWriter> writer = TorchArchiveWriter::Create(path);
    if (!writer.ok()) return writer.status();
    if (Result<uint64_t> size = writer->Finish(graph.root()); !size.ok()) return size.status();
    return path;
  }

  // The file at `path` with its folding dict set for rank `writer` of `grid`, written beside it.
  Result<TorchArchiveReader> Refold(const std::string& path, const FoldedGrid& grid,
                                    uint32_t writer_rank) {
    Result<TorchArchiveReader> source = TorchArchiveReader::Open(path);
    if (!source.ok()) return source.status();
    pickle::Graph graph;
    pickle::Value* root = graph.Import(source->root());
    graph.set_root(root);
    if (Status status = SetFolding(graph, root, *source, grid, writer_rank); !status.ok()) {
      return status;
    }
    const std::string out = dir_.path() + "/refolded.pt";
    Result<TorchArchiveWriter> writer = TorchArchiveWriter::Create(out);
    if (!writer.ok()) return writer.status();
    if (Result<uint64_t> size = writer->Finish(graph.root()); !size.ok()) return size.status();
    return TorchArchiveReader::Open(out);
  }

  TempDir dir_;
};

// Rank 6 of T4E2 at 8 ranks: TP rank 2, dense rank 1 of 2, expert-parallel rank 0, expert DP rank
// 3 of 4.
TEST_F(SetFoldingTest, TheDictAndEachParamFamilyTakeTheWritersRanksInTheNewGrid) {
  Result<std::string> path = Write("dense_dp");
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  const FoldedGrid grid{8, 4, 2};
  Result<TorchArchiveReader> reader = Refold(*path, grid, 6);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  const Status check = CheckFolding(*reader, kZeroFamily, grid, 2, 0, 1);
  EXPECT_TRUE(check.ok()) << check.ToString();
  const auto field = [&](const std::string& name) -> int64_t {
    Result<int64_t> value = IntField(*reader, "folding/" + name);
    return value.ok() ? *value : -1;
  };
  EXPECT_EQ(field("zero_partition_count"), 2);
  EXPECT_EQ(field("param_families/q.weight/zero_partition_rank"), 1);
  EXPECT_EQ(field("param_families/q.weight/zero_partition_count"), 2);
  EXPECT_EQ(field("param_families/experts.w1/zero_partition_rank"), 3);
  EXPECT_EQ(field("param_families/experts.w1/zero_partition_count"), 4);
}

TEST_F(SetFoldingTest, AnUnknownPartitionGroupIsRefusedNamingTheField) {
  Result<std::string> path = Write("tp_group");
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  Result<TorchArchiveReader> reader = Refold(*path, FoldedGrid{8, 4, 2}, 6);
  ASSERT_FALSE(reader.ok());
  EXPECT_THAT(reader.status().ToString(),
              AllOf(HasSubstr("zero_pp_rank_1_mp_rank_01_optim_states.pt"),
                    HasSubstr("folding/param_families/q.weight/zero_partition_group")));
}

}  // namespace
}  // namespace ucp::deepspeed
