#include "core/format/pickle_value.h"

#include <gtest/gtest.h>

#include <limits>
#include <string>

namespace ucp::pickle {
namespace {

TEST(PickleValueTest, IntsTakeTheFastPathWhenTheyFit) {
  Graph g;
  // INT64_MIN in eight bytes, and with redundant sign-extension bytes.
  const std::string min_bytes("\x00\x00\x00\x00\x00\x00\x00\x80", 8);
  EXPECT_EQ(g.IntFromBytes(min_bytes)->AsInt64(), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(g.IntFromBytes(min_bytes + "\xff\xff")->AsInt64(), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(g.IntFromBytes("")->AsInt64(), 0);
  EXPECT_EQ(g.IntFromBytes("\xff")->AsInt64(), -1);
  EXPECT_EQ(g.IntFromBytes(std::string("\xff\x00", 2))->AsInt64(), 255);
  // 2^63 needs a ninth byte.
  const Value* big = g.IntFromBytes(std::string("\x00\x00\x00\x00\x00\x00\x00\x80\x00", 9));
  EXPECT_FALSE(big->AsInt64().has_value());
  EXPECT_EQ(big->IntDecimal(), std::to_string(std::numeric_limits<uint64_t>::max() / 2 + 1));
  // The encoding is the minimal one for both paths.
  EXPECT_EQ(g.Int(255)->IntBytes(), std::string("\xff\x00", 2));
  EXPECT_EQ(g.Int(-128)->IntBytes(), "\x80");
  EXPECT_EQ(g.Int(0)->IntBytes(), "");
}

TEST(PickleValueTest, GetFindsTheLastStrKey) {
  Graph g;
  Value* d = g.Dict({{g.Str("k"), g.Int(1)}, {g.Int(5), g.Int(2)}, {g.Str("k"), g.Int(3)}});
  EXPECT_EQ(d->Get("k")->AsInt64(), 3);
  EXPECT_EQ(d->Get("5"), nullptr);
  Value* od = g.Object(Construction::kReduce, g.Global("collections", "OrderedDict"), g.Tuple({}));
  od->mutable_mutations().push_back({Mutation::Op::kSetItem, g.Str("w"), g.Int(7)});
  od->mutable_mutations().push_back({Mutation::Op::kBuild, g.Dict({}), nullptr});
  EXPECT_EQ(od->Get("w")->AsInt64(), 7);
  EXPECT_NE(od->State(), nullptr);
  EXPECT_TRUE(od->IsCallOf("collections", "OrderedDict"));
  EXPECT_EQ(g.Int(1)->Get("w"), nullptr);
}

TEST(PickleValueTest, ImportKeepsSharingAndCycles) {
  Graph source;
  Value* shared = source.List({source.Str("x")});
  Value* root = source.Dict({{source.Str("a"), shared}, {source.Str("b"), shared}});
  shared->mutable_items().push_back(root);
  Graph target;
  Value* copy = target.Import(root);
  EXPECT_EQ(target.size(), source.size());
  EXPECT_NE(copy, root);
  EXPECT_EQ(copy->Get("a"), copy->Get("b"));
  EXPECT_EQ(copy->Get("a")->Item(1), copy);
  EXPECT_EQ(Render(copy).value(), Render(root).value());
}

TEST(PickleValueTest, ForEachReachableVisitsEachNodeOnce) {
  Graph g;
  Value* leaf = g.Str("leaf");
  Value* list = g.List({leaf, leaf});
  list->mutable_items().push_back(list);
  int visits = 0;
  ASSERT_TRUE(ForEachReachable(list, [&](Value*) {
                ++visits;
                return Status::Ok();
              }).ok());
  EXPECT_EQ(visits, 2);
  const Status stop = ForEachReachable(list, [](Value* v) {
    return v->kind() == Kind::kStr ? Status::NotFound("stop") : Status::Ok();
  });
  EXPECT_EQ(stop.code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace ucp::pickle
