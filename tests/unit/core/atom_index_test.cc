// Tests core/format/atom_index.cc: JSON round trips, atomic writes, and every validation rule,
// each failure checked for the field path it names.
#include "core/format/atom_index.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <xxhash.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace ucp {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

Region Flat(uint64_t begin, uint64_t end, const Shape& shape) {
  return Region::Flat(begin, end, shape).value();
}

// A small two-rank index: "w" (3×4 fp32) split flat across both optimizer files, "b" (4) held
// by rank 0, and "w"'s exp_avg as two row boxes.
AtomIndexContents SampleContents() {
  AtomIndexContents c;
  c.framework = "deepspeed";
  c.framework_version = "0.14.5";
  c.adapter = "deepspeed-zero12";
  c.adapter_schema = 1;
  c.tag = "global_step5";
  c.topology = {2, 1, 1, 2, 2};
  c.files = {
      {"mp_rank_00_model_states.pt", 1000, 0x0123456789abcdefull, "model_states", std::nullopt},
      {"zero_pp_rank_0_mp_rank_00_optim_states.pt", 4096, 0xfedcba9876543210ull, "optim_states",
       RankCoordinates{0, 0, 0}},
      {"zero_pp_rank_1_mp_rank_00_optim_states.pt", 4096, 42, "optim_states",
       RankCoordinates{1, 0, 0}},
  };
  const Shape w{3, 4};
  const Shape b{4};
  c.atoms = {
      {"w",
       "fp32",
       DType::kFloat32,
       w,
       {{1, 64, DType::kFloat32, Flat(0, 7, w)}, {2, 64, DType::kFloat32, Flat(7, 12, w)}}},
      {"b", "fp32", DType::kFloat32, b, {{1, 92, DType::kFloat32, Flat(0, 4, b)}}},
      {"w",
       "exp_avg",
       DType::kFloat32,
       w,
       {{1, 128, DType::kFloat32, Region::Box({0, 0}, {2, 4}, w).value()},
        {2, 128, DType::kFloat32, Region::Box({2, 0}, {1, 4}, w).value()}}},
  };
  ParamGroup group;
  group.params = {"w", "b"};
  group.hyperparameters = {{"lr", 0.003}, {"betas", {0.9, 0.999}}, {"weight_decay", 0.0}};
  group.scalars = {{"step", 5}};
  c.groups = {group};
  c.carried = {{"model_states", 0, {"dp_world_size"}}};
  c.adapter_state = {{"zero_stage", 2}, {"nested", {{"z", 1}, {"a", "x"}}}};
  return c;
}

std::string SampleJson() { return AtomIndex::Create(SampleContents()).value().ToJson(); }

// `json` parsed, without its "checksum" (as indexes were written before the member existed), so
// that a mutation meets the rule it breaks rather than the checksum.
Json Unchecked(const std::string& json) {
  Json doc = Json::parse(json);
  doc.erase("checksum");
  return doc;
}

class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            ("atom_index_test." + std::to_string(::getpid()) + "." +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string Path(const std::string& name) const { return (path_ / name).string(); }
  std::filesystem::path root() const { return path_; }

 private:
  std::filesystem::path path_;
};

TEST(AtomIndexTest, RoundTripThroughJson) {
  const AtomIndex index = AtomIndex::Create(SampleContents()).value();
  const std::string json = index.ToJson();
  const AtomIndex parsed = AtomIndex::Parse(json, "<test>").value();
  EXPECT_EQ(parsed.ToJson(), json);

  const AtomIndexContents& c = parsed.contents();
  const AtomIndexContents expected = SampleContents();
  EXPECT_EQ(c.framework, expected.framework);
  EXPECT_EQ(c.framework_version, expected.framework_version);
  EXPECT_EQ(c.adapter, expected.adapter);
  EXPECT_EQ(c.tag, expected.tag);
  EXPECT_EQ(c.topology, expected.topology);
  ASSERT_EQ(c.files.size(), expected.files.size());
  for (size_t i = 0; i < c.files.size(); ++i) {
    EXPECT_EQ(c.files[i].path, expected.files[i].path);
    EXPECT_EQ(c.files[i].size, expected.files[i].size);
    EXPECT_EQ(c.files[i].xxh3, expected.files[i].xxh3);
    EXPECT_EQ(c.files[i].role, expected.files[i].role);
    EXPECT_EQ(c.files[i].rank, expected.files[i].rank);
  }
  ASSERT_EQ(c.atoms.size(), expected.atoms.size());
  for (size_t a = 0; a < c.atoms.size(); ++a) {
    EXPECT_EQ(c.atoms[a].param, expected.atoms[a].param);
    EXPECT_EQ(c.atoms[a].state, expected.atoms[a].state);
    EXPECT_EQ(c.atoms[a].dtype, expected.atoms[a].dtype);
    EXPECT_EQ(c.atoms[a].shape, expected.atoms[a].shape);
    ASSERT_EQ(c.atoms[a].fragments.size(), expected.atoms[a].fragments.size());
    for (size_t f = 0; f < c.atoms[a].fragments.size(); ++f) {
      EXPECT_EQ(c.atoms[a].fragments[f].file, expected.atoms[a].fragments[f].file);
      EXPECT_EQ(c.atoms[a].fragments[f].offset, expected.atoms[a].fragments[f].offset);
      EXPECT_EQ(c.atoms[a].fragments[f].region, expected.atoms[a].fragments[f].region);
    }
  }
  ASSERT_EQ(c.groups.size(), 1u);
  EXPECT_EQ(c.groups[0].params, expected.groups[0].params);
  EXPECT_EQ(c.groups[0].hyperparameters, expected.groups[0].hyperparameters);
  EXPECT_EQ(c.groups[0].scalars, expected.groups[0].scalars);
  ASSERT_EQ(c.carried.size(), 1u);
  EXPECT_EQ(c.carried[0].file, 0u);
  EXPECT_EQ(c.carried[0].rewritten, expected.carried[0].rewritten);
  EXPECT_EQ(c.adapter_state, expected.adapter_state);
}

TEST(AtomIndexTest, DocumentFieldsAsSpecified) {
  const Json doc = Json::parse(SampleJson());
  EXPECT_EQ(doc["format"], "ucp-atom-index");
  EXPECT_EQ(doc["version"], 1);
  EXPECT_EQ(doc["files"][0]["xxh3"], "0123456789abcdef");
  EXPECT_EQ(doc["files"][2]["xxh3"], "000000000000002a");
  EXPECT_FALSE(doc["files"][0].contains("rank"));
  EXPECT_EQ(doc["files"][2]["rank"], (Json{{"dp", 1}, {"tp", 0}, {"pp", 0}}));
  EXPECT_EQ(doc["atoms"][0]["dtype"], "float32");
  EXPECT_EQ(doc["atoms"][0]["fragments"][1]["region"], (Json{{"flat", {7, 12}}}));
  EXPECT_EQ(doc["atoms"][2]["fragments"][1]["region"],
            (Json{{"box", {{"offsets", {2, 0}}, {"extents", {1, 4}}}}}));
}

TEST(AtomIndexTest, ChecksumCoversTheDocument) {
  const Json doc = Json::parse(SampleJson());
  ASSERT_TRUE(doc.contains("checksum"));
  // Recomputed here from the spec: XXH3-64 of the compact, sorted dump without the member.
  const std::string canonical = Unchecked(SampleJson()).dump();
  char expected[17];
  std::snprintf(expected, sizeof(expected), "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(canonical.data(), canonical.size())));
  EXPECT_EQ(doc["checksum"], expected);

  // A change that every other rule accepts: the second fragment of atom 0 starts 4 bytes later,
  // still inside its file.
  Json moved = doc;
  moved["atoms"][0]["fragments"][1]["offset"] =
      moved["atoms"][0]["fragments"][1]["offset"].get<uint64_t>() + 4;
  Json unchecked_moved = moved;
  unchecked_moved.erase("checksum");
  ASSERT_TRUE(AtomIndex::Parse(unchecked_moved.dump(), "x.json").ok());
  const Status status = AtomIndex::Parse(moved.dump(), "x.json").status();
  EXPECT_EQ(status.code(), StatusCode::kCorrupt);
  EXPECT_THAT(status.message(), HasSubstr("atom index x.json: checksum: the document hashes to"));
  EXPECT_THAT(status.message(), HasSubstr("changed after it was written"));

  // Whitespace and member order are not part of the checksum; a missing one is accepted.
  EXPECT_TRUE(AtomIndex::Parse(doc.dump(4), "x.json").ok());
  EXPECT_TRUE(AtomIndex::Parse(Unchecked(SampleJson()).dump(), "x.json").ok());
  Json not_a_string = doc;
  not_a_string["checksum"] = 1;
  EXPECT_THAT(AtomIndex::Parse(not_a_string.dump(), "x.json").status().message(),
              HasSubstr("x.json: checksum: not a string"));
}

TEST(AtomIndexTest, OutputIsDeterministic) {
  AtomIndexContents reordered = SampleContents();
  // Same JSON object built in another insertion order.
  reordered.adapter_state = Json::object();
  reordered.adapter_state["nested"] = {{"a", "x"}, {"z", 1}};
  reordered.adapter_state["zero_stage"] = 2;
  EXPECT_EQ(AtomIndex::Create(std::move(reordered)).value().ToJson(), SampleJson());
}

TEST(AtomIndexTest, Find) {
  const AtomIndex index = AtomIndex::Create(SampleContents()).value();
  ASSERT_NE(index.Find("w", "exp_avg"), nullptr);
  EXPECT_EQ(index.Find("w", "exp_avg")->fragments.size(), 2u);
  EXPECT_EQ(index.Find("b", "exp_avg"), nullptr);
  ASSERT_NE(index.FindFile("mp_rank_00_model_states.pt"), nullptr);
  EXPECT_EQ(index.FindFile("mp_rank_00_model_states.pt")->size, 1000u);
  EXPECT_EQ(index.FindFile("nothing.pt"), nullptr);
}

TEST(AtomIndexTest, WriteIsAtomicAndReadable) {
  TempDir dir;
  const std::string path = dir.Path("global_step5/.ucp/index.json");
  const AtomIndex index = AtomIndex::Create(SampleContents()).value();
  ASSERT_TRUE(index.Write(path).ok());
  const AtomIndex read = AtomIndex::Read(path).value();
  EXPECT_EQ(read.ToJson(), index.ToJson());
  // Overwrite leaves exactly the one file behind (no temporaries).
  ASSERT_TRUE(index.Write(path).ok());
  size_t entries = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(dir.root() / "global_step5" / ".ucp")) {
    EXPECT_EQ(entry.path().filename(), "index.json");
    ++entries;
  }
  EXPECT_EQ(entries, 1u);
  EXPECT_EQ(AtomIndex::Read(dir.Path("missing.json")).status().code(), StatusCode::kNotFound);
}

TEST(AtomIndexTest, ReadNamesThePath) {
  TempDir dir;
  const std::string path = dir.Path("index.json");
  std::ofstream(path) << "{\"format\": \"ucp-atom-index\"";
  const Status status = AtomIndex::Read(path).status();
  EXPECT_EQ(status.code(), StatusCode::kCorrupt);
  EXPECT_THAT(status.message(), HasSubstr("atom index " + path + ": not a valid JSON document"));
}

TEST(AtomIndexTest, ChunkHashesRoundTripAsVersion3AndMustFitTheirFile) {
  AtomIndexContents c = SampleContents();
  c.files[1].chunks = {1024, {1, 2, 3, 4}};
  const AtomIndex index = AtomIndex::Create(c).value();
  const Json doc = Json::parse(index.ToJson());
  EXPECT_EQ(doc["version"], 3);
  EXPECT_EQ(doc["files"][1]["chunk_bytes"], 1024);
  EXPECT_EQ(doc["files"][1]["chunks"],
            "0000000000000001000000000000000200000000000000030000000000000004");
  EXPECT_FALSE(doc["files"][0].contains("chunks"));
  Result<AtomIndex> parsed = AtomIndex::Parse(index.ToJson(), "x.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->files()[1].chunks, c.files[1].chunks);
  EXPECT_FALSE(parsed->files()[0].chunks.recorded());
  // Without chunk hashes the document stays version 1, as readers before them expect.
  EXPECT_EQ(Json::parse(SampleJson())["version"], 1);

  c.files[1].chunks.chunk_bytes = 1000;  // 4096 bytes are 5 chunks of 1000
  const Status misfit = AtomIndex::Create(c).status();
  EXPECT_EQ(misfit.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(misfit.message(), HasSubstr("files[1].chunks: 4 chunk hashes for 4096 bytes"));

  Json older = Unchecked(index.ToJson());
  older["version"] = 2;
  const Status unknown = AtomIndex::Parse(older.dump(), "x.json").status();
  EXPECT_EQ(unknown.code(), StatusCode::kCorrupt);
  EXPECT_THAT(unknown.message(), HasSubstr("files[1].chunk_bytes: unknown member"));
}

TEST(AtomIndexTest, NewerVersionIsUnsupported) {
  Json doc = Unchecked(SampleJson());
  doc["version"] = 4;
  doc["something_new"] = true;
  const Status status = AtomIndex::Parse(doc.dump(), "x.json").status();
  EXPECT_EQ(status.code(), StatusCode::kUnsupported);
  EXPECT_THAT(status.message(), HasSubstr("version 4 is newer than this reader (3)"));
}

struct DocumentCase {
  std::string name;
  std::function<void(Json&)> mutate;
  std::string message;
};

// Each edit of a valid document must fail to parse with kCorrupt naming the field.
TEST(AtomIndexTest, DocumentValidation) {
  const std::vector<DocumentCase> cases = {
      {"format", [](Json& d) { d["format"] = "other"; }, "format: \"other\" is not an atom index"},
      {"version0", [](Json& d) { d["version"] = 0; }, "version: version 0 does not exist"},
      {"version-type", [](Json& d) { d["version"] = "1"; }, "version: not a non-negative integer"},
      {"unknown", [](Json& d) { d["extra"] = 1; }, "extra: unknown member"},
      {"missing", [](Json& d) { d.erase("carried"); }, "carried: missing"},
      {"framework", [](Json& d) { d["framework"]["name"] = 3; }, "framework.name: not a string"},
      {"empty-framework", [](Json& d) { d["framework"]["name"] = ""; }, "framework.name: empty"},
      {"tag", [](Json& d) { d["tag"] = "a/b"; }, "tag: \"a/b\" is not a directory name"},
      {"topology-zero", [](Json& d) { d["topology"]["tp"] = 0; }, "topology: dp, tp and pp"},
      {"world", [](Json& d) { d["topology"]["world"] = 3; }, "topology.world: 3 is not dp"},
      {"stage", [](Json& d) { d["topology"]["zero_stage"] = 4; }, "topology.zero_stage"},
      {"negative", [](Json& d) { d["files"][1]["size"] = -1; },
       "files[1].size: not a non-negative integer"},
      {"float", [](Json& d) { d["files"][1]["size"] = 1.5; },
       "files[1].size: not a non-negative integer"},
      {"u32", [](Json& d) { d["atoms"][0]["fragments"][0]["file"] = 1ull << 32; },
       "atoms[0].fragments[0].file: exceeds 32 bits"},
      {"absolute", [](Json& d) { d["files"][1]["path"] = "/etc/passwd"; },
       "files[1].path: \"/etc/passwd\" is not a normalised path inside the tag"},
      {"dotdot", [](Json& d) { d["files"][1]["path"] = "../x.pt"; }, "files[1].path"},
      {"dot", [](Json& d) { d["files"][1]["path"] = "a/./x.pt"; }, "files[1].path"},
      {"empty-component", [](Json& d) { d["files"][1]["path"] = "a//x.pt"; }, "files[1].path"},
      {"trailing-slash", [](Json& d) { d["files"][1]["path"] = "a/"; }, "files[1].path"},
      {"duplicate-file", [](Json& d) { d["files"][2]["path"] = d["files"][1]["path"]; },
       "files[2].path: \"zero_pp_rank_0_mp_rank_00_optim_states.pt\" is listed twice"},
      {"xxh3-upper", [](Json& d) { d["files"][0]["xxh3"] = "0123456789ABCDEF"; },
       "files[0].xxh3: not 16 lower-case hex digits"},
      {"xxh3-short", [](Json& d) { d["files"][0]["xxh3"] = "abc"; }, "files[0].xxh3"},
      {"role", [](Json& d) { d["files"][0]["role"] = ""; }, "files[0].role: empty"},
      {"rank", [](Json& d) { d["files"][2]["rank"]["dp"] = 2; },
       "files[2].rank: outside the topology"},
      {"rank-member", [](Json& d) { d["files"][2]["rank"]["ep"] = 0; },
       "files[2].rank.ep: unknown member"},
      {"duplicate-atom", [](Json& d) { d["atoms"][1]["param"] = "w"; },
       "atoms[1]: atom (w, fp32) is listed twice"},
      {"dtype", [](Json& d) { d["atoms"][1]["dtype"] = "float"; },
       "atoms[1].dtype: unknown dtype \"float\""},
      {"fragment-dtype", [](Json& d) { d["atoms"][1]["fragments"][0]["dtype"] = "float16"; },
       "atoms[1].fragments[0].dtype: float16 differs from the atom's float32"},
      {"shape-overflow",
       [](Json& d) {
         d["atoms"][1]["shape"] = {1ull << 40, 1ull << 40};
       },
       "atoms[1].shape: shape [1099511627776, 1099511627776]: element count overflows"},
      {"file-index", [](Json& d) { d["atoms"][0]["fragments"][1]["file"] = 3; },
       "atoms[0].fragments[1].file: file 3 does not exist (3 files)"},
      {"offset", [](Json& d) { d["atoms"][0]["fragments"][1]["offset"] = 4096 - 19; },
       "atoms[0].fragments[1].offset: beyond the end of file "
       "zero_pp_rank_1_mp_rank_00_optim_states.pt (size 4096)"},
      {"offset-overflow", [](Json& d) { d["atoms"][0]["fragments"][1]["offset"] = ~0ull; },
       "atoms[0].fragments[1].offset: beyond the end"},
      {"region-bounds",
       [](Json& d) {
         d["atoms"][0]["fragments"][1]["region"]["flat"] = {7, 13};
       },
       "atoms[0].fragments[1].region: region flat[7,13) does not fit shape [3, 4]"},
      {"region-pair", [](Json& d) { d["atoms"][0]["fragments"][1]["region"]["flat"] = {7}; },
       "atoms[0].fragments[1].region.flat: not [begin, end]"},
      {"region-both",
       [](Json& d) {
         d["atoms"][0]["fragments"][1]["region"]["box"] = {{"offsets", {0}}, {"extents", {1}}};
       },
       "atoms[0].fragments[1].region: needs exactly one of"},
      {"box-rank", [](Json& d) { d["atoms"][2]["fragments"][1]["region"]["box"]["offsets"] = {2}; },
       "atoms[2].fragments[1].region: region box with 1 offsets and 2 extents"},
      {"gap",
       [](Json& d) {
         d["atoms"][0]["fragments"][1]["region"]["flat"] = {8, 12};
       },
       "atoms[0].fragments: the regions (by fragment index) do not tile the atom: tiling of "
       "shape [3, 4]: element 7 [1, 3] is held by no region"},
      {"double",
       [](Json& d) {
         d["atoms"][2]["fragments"][1]["region"]["box"] = {{"offsets", {1, 0}},
                                                           {"extents", {2, 4}}};
       },
       "element 4 [1, 0] is held twice, by regions 0 (box[0:2,0:4]) and 1 (box[1:3,0:4])"},
      {"group-param", [](Json& d) { d["groups"][0]["params"][1] = "c"; },
       "groups[0].params[1]: \"c\" is the param of no atom"},
      {"group-twice", [](Json& d) { d["groups"][0]["params"][1] = "w"; },
       "groups[0].params[1]: \"w\" is in more than one group"},
      {"hyperparameters", [](Json& d) { d["groups"][0]["hyperparameters"] = 1; },
       "groups[0].hyperparameters: not an object"},
      {"scalars",
       [](Json& d) {
         d["groups"][0]["scalars"] = {1, 2};
       },
       "groups[0].scalars: not an object"},
      {"carried-file", [](Json& d) { d["carried"][0]["file"] = 7; },
       "carried[0].file: file 7 does not exist"},
      {"carried-rewritten", [](Json& d) { d["carried"][0]["rewritten"] = {1}; },
       "carried[0].rewritten[0]: not a string"},
      {"adapter-state", [](Json& d) { d["adapter_state"] = "x"; }, "adapter_state: not an object"},
      {"atoms-type", [](Json& d) { d["atoms"] = Json::object(); }, "atoms: not an array"},
  };
  for (const DocumentCase& test : cases) {
    Json doc = Unchecked(SampleJson());
    test.mutate(doc);
    const Status status = AtomIndex::Parse(doc.dump(), "/ck/global_step5/.ucp/index.json").status();
    EXPECT_EQ(status.code(), StatusCode::kCorrupt) << test.name << ": " << status.ToString();
    EXPECT_THAT(status.message(), HasSubstr("atom index /ck/global_step5/.ucp/index.json: "))
        << test.name;
    EXPECT_THAT(status.message(), HasSubstr(test.message)) << test.name;
  }
}

TEST(AtomIndexTest, CreateValidatesContents) {
  AtomIndexContents c = SampleContents();
  c.atoms[0].fragments[0].region = Flat(0, 12, Shape{12});
  const Status status = AtomIndex::Create(std::move(c), "mine").status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("atom index mine: atoms[0].fragments[0].region: flat[0,12) is of "
                        "another shape than the atom"));

  AtomIndexContents empty_state = SampleContents();
  empty_state.atoms[1].state = "";
  EXPECT_THAT(AtomIndex::Create(std::move(empty_state)).status().message(),
              HasSubstr("atom index <memory>: atoms[1].state: empty"));
}

TEST(AtomIndexTest, ZeroDimensionalAndEmptyAtoms) {
  AtomIndexContents c = SampleContents();
  c.atoms.push_back({"w", "step", DType::kInt64, Shape{}, {{0, 8, DType::kInt64, Flat(0, 1, {})}}});
  c.atoms.push_back({"empty", "fp32", DType::kFloat32, Shape{0, 5}, {}});
  const AtomIndex index = AtomIndex::Create(std::move(c)).value();
  const AtomIndex parsed = AtomIndex::Parse(index.ToJson(), "<test>").value();
  EXPECT_EQ(parsed.Find("w", "step")->shape, Shape{});
  EXPECT_EQ(parsed.Find("empty", "fp32")->fragments.size(), 0u);
}

// SampleContents with an atoms store: the three atoms in one consolidated file (w fp32 at 0,
// b fp32 at 48, w exp_avg at 64) and the carried model-states file copied.
AtomIndexContents StoreContents() {
  AtomIndexContents c = SampleContents();
  c.store = AtomsStore{".ucp/atoms", 1 << 20};
  c.files.push_back(
      {".ucp/atoms/all.safetensors", 112, 7, std::string(kStoreAtomsRole), std::nullopt});
  c.files.push_back({".ucp/atoms/carried.mp_rank_00_model_states.pt", c.files[0].size,
                     c.files[0].xxh3, std::string(kStoreCopyRole), std::nullopt, 0});
  c.atoms[0].consolidated = ConsolidatedCopy{3, 0};
  c.atoms[1].consolidated = ConsolidatedCopy{3, 48};
  c.atoms[2].consolidated = ConsolidatedCopy{3, 64};
  return c;
}

TEST(AtomIndexTest, StoreRoundTripsAsVersion2) {
  const AtomIndex index = AtomIndex::Create(StoreContents()).value();
  const Json doc = Json::parse(index.ToJson());
  EXPECT_EQ(doc["version"], 2);
  EXPECT_EQ(doc["store"]["directory"], ".ucp/atoms");
  EXPECT_EQ(doc["store"]["max_shard_bytes"], 1 << 20);
  EXPECT_EQ(doc["files"][4]["copy_of"], 0);
  EXPECT_EQ(doc["atoms"][1]["consolidated"], Json::parse(R"({"file": 3, "offset": 48})"));
  const AtomIndex parsed = AtomIndex::Parse(index.ToJson(), "<test>").value();
  EXPECT_EQ(parsed.ToJson(), index.ToJson());
  EXPECT_EQ(parsed.files()[4].copy_of, std::optional<uint32_t>(0));
  EXPECT_EQ(parsed.Find("w", "exp_avg")->consolidated, (ConsolidatedCopy{3, 64}));
  // Without a store the document stays version 1, readable by version-1 readers.
  EXPECT_EQ(Json::parse(SampleJson())["version"], 1);
}

TEST(AtomIndexTest, OverStoreReadsOnlyStoreFiles) {
  const AtomIndex index = AtomIndex::Create(StoreContents()).value();
  const AtomIndex over = index.OverStore().value();
  EXPECT_FALSE(over.contents().store.has_value());
  ASSERT_EQ(over.files().size(), 4u);
  // The carried file keeps its index and role; its bytes are the copy's.
  EXPECT_EQ(over.files()[0].path, ".ucp/atoms/carried.mp_rank_00_model_states.pt");
  EXPECT_EQ(over.files()[0].role, "model_states");
  EXPECT_EQ(over.contents().carried[0].file, 0u);
  EXPECT_EQ(over.files()[3].path, ".ucp/atoms/all.safetensors");
  for (const Atom& atom : over.atoms()) {
    ASSERT_EQ(atom.fragments.size(), 1u) << atom.param << "/" << atom.state;
    EXPECT_EQ(atom.fragments[0].file, 3u);
    EXPECT_EQ(atom.fragments[0].region, Region::Whole(atom.shape).value());
    EXPECT_EQ(atom.fragments[0].offset, index.Find(atom.param, atom.state)->consolidated->offset);
    EXPECT_FALSE(atom.consolidated.has_value());
  }
  EXPECT_EQ(AtomIndex::Create(SampleContents()).value().OverStore().status().code(),
            StatusCode::kFailedPrecondition);
}

struct ContentsCase {
  std::string name;
  std::function<void(AtomIndexContents&)> mutate;
  std::string message;
};

TEST(AtomIndexTest, StoreValidation) {
  const std::vector<ContentsCase> cases = {
      {"no-store-copy", [](AtomIndexContents& c) { c.store.reset(); },
       "files[4].copy_of: no store"},
      {"no-store-consolidated",
       [](AtomIndexContents& c) {
         c.store.reset();
         c.files.pop_back();
         c.files.pop_back();
         c.atoms[0].consolidated = ConsolidatedCopy{0, 0};
       },
       "atoms[0].consolidated: no store"},
      {"directory", [](AtomIndexContents& c) { c.store->directory = "../atoms"; },
       "store.directory: \"../atoms\" is not a normalised path"},
      {"outside", [](AtomIndexContents& c) { c.files[3].path = "all.safetensors"; },
       "files[3].path: \"all.safetensors\" with role \"ucp-atoms\": store files, and only they"},
      {"framework-inside", [](AtomIndexContents& c) { c.files[1].path = ".ucp/atoms/x.pt"; },
       "files[1].path"},
      {"copy-role", [](AtomIndexContents& c) { c.files[4].copy_of.reset(); },
       "files[4].copy_of: exactly the files with role ucp-copy have one"},
      {"copy-of-store", [](AtomIndexContents& c) { c.files[4].copy_of = 3; },
       "files[4].copy_of: 3 is not a framework file of the index"},
      {"copy-differs", [](AtomIndexContents& c) { c.files[4].xxh3 = 1; },
       "files[4].copy_of: size or xxh3 differs from mp_rank_00_model_states.pt's"},
      {"carried-uncopied",
       [](AtomIndexContents& c) {
         c.carried.push_back({"optim", 1, {}});
       },
       "carried[1].file: zero_pp_rank_0_mp_rank_00_optim_states.pt has 0 copies in the store"},
      {"missing", [](AtomIndexContents& c) { c.atoms[2].consolidated.reset(); },
       "atoms[2].consolidated: missing (the index has a store)"},
      {"not-atoms-file", [](AtomIndexContents& c) { c.atoms[2].consolidated->file = 4; },
       "atoms[2].consolidated.file: 4 is not a file with role ucp-atoms"},
      {"beyond", [](AtomIndexContents& c) { c.atoms[2].consolidated->offset = 65; },
       "atoms[2].consolidated.offset: beyond the end of file .ucp/atoms/all.safetensors"},
      {"overflow", [](AtomIndexContents& c) { c.atoms[2].consolidated->offset = UINT64_MAX; },
       "atoms[2].consolidated.offset: beyond the end"},
  };
  for (const ContentsCase& test : cases) {
    AtomIndexContents c = StoreContents();
    test.mutate(c);
    const Status status = AtomIndex::Create(std::move(c)).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << test.name;
    EXPECT_THAT(status.message(), HasSubstr(test.message)) << test.name;
  }
}

TEST(AtomIndexTest, Version1DocumentHasNoStoreMembers) {
  Json doc = Unchecked(AtomIndex::Create(StoreContents()).value().ToJson());
  doc["version"] = 1;
  EXPECT_THAT(AtomIndex::Parse(doc.dump(), "x.json").status().message(),
              HasSubstr("x.json: store: unknown member"));
  doc.erase("store");
  EXPECT_THAT(AtomIndex::Parse(doc.dump(), "x.json").status().message(),
              HasSubstr("x.json: files[4].copy_of: unknown member"));
  doc["files"].erase(4);
  EXPECT_THAT(AtomIndex::Parse(doc.dump(), "x.json").status().message(),
              HasSubstr("x.json: atoms[0].consolidated: unknown member"));
}

}  // namespace
}  // namespace ucp
