// Tests core/plan/executor.cc and core/plan/export_plan.cc on small synthetic source files: every
// output must equal the same file written from bytes assembled in memory (the writers are tested
// on their own), and plans that are wrong or sources that changed must fail before any output
// path is written.
#include "core/plan/executor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "core/format/safetensors_reader.h"
#include "core/format/safetensors_writer.h"
#include "core/format/torch_archive_writer.h"
#include "core/format/zip_reader.h"
#include "core/io/fault_injection.h"
#include "core/plan/export_plan.h"
#include "core/util/chunked_xxh3.h"
#include "test_bytes.h"

namespace ucp {
namespace {

using ::testing::HasSubstr;

using testing::ReadAll;

class ExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = testing::ScratchDirectory("ucp_executor_test");
    std::filesystem::create_directories(root_ / "tag");
    std::filesystem::create_directories(root_ / "out");
    std::filesystem::create_directories(root_ / "expected");
    const size_t sizes[] = {300'000, 5'000, 1'000'003};
    for (uint32_t f = 0; f < 3; ++f) {
      sources_.push_back(testing::Pattern(sizes[f], 100 + f));
      std::ofstream(Tag("src" + std::to_string(f) + ".bin"), std::ios::binary)
          .write(reinterpret_cast<const char*>(sources_[f].data()),
                 static_cast<std::streamsize>(sources_[f].size()));
    }
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  std::string Tag(const std::string& name) const { return (root_ / "tag" / name).string(); }
  std::string Out(const std::string& name) const { return (root_ / "out" / name).string(); }
  std::string Expected(const std::string& name) const {
    return (root_ / "expected" / name).string();
  }

  // Two atoms over the three sources: "w" (fp32, 100×50) in three flat fragments, "b" (bf16,
  // 3000) in one; each with an "exp_avg" state.
  AtomIndex Index() const {
    AtomIndexContents c;
    c.framework = "test";
    c.adapter = "test";
    c.tag = "tag";
    for (uint32_t f = 0; f < 3; ++f) {
      c.files.push_back({"src" + std::to_string(f) + ".bin", sources_[f].size(), 0, "data", {}});
    }
    const Shape w{100, 50};
    const Shape b{3000};
    c.atoms = {
        {"w",
         "fp32",
         DType::kFloat32,
         w,
         {{2, 1000, DType::kFloat32, Region::Flat(0, 2000, w).value()},
          {0, 64, DType::kFloat32, Region::Flat(2000, 4500, w).value()},
          {2, 999'003 - 2000, DType::kFloat32, Region::Flat(4500, 5000, w).value()}}},
        {"b",
         "fp32",
         DType::kBFloat16,
         b,
         {{0, 200'000, DType::kBFloat16, Region::Whole(b).value()}}},
        {"w",
         "exp_avg",
         DType::kFloat32,
         w,
         {{2, 100'000, DType::kFloat32, Region::Whole(w).value()}}},
        {"b",
         "exp_avg",
         DType::kBFloat16,
         b,
         {{1, 0, DType::kBFloat16, Region::Flat(0, 2500, b).value()},
          {0, 0, DType::kBFloat16, Region::Flat(2500, 3000, b).value()}}},
    };
    return AtomIndex::Create(std::move(c)).value();
  }

  // The bytes of `segments`, assembled from the in-memory sources.
  std::vector<std::byte> Bytes(const std::vector<Segment>& segments) const {
    std::vector<std::byte> out;
    for (const Segment& s : segments) {
      if (s.zero_fill()) {
        out.insert(out.end(), s.length, std::byte{0});
      } else {
        const auto begin = sources_[s.file].begin() + static_cast<ptrdiff_t>(s.offset);
        out.insert(out.end(), begin, begin + static_cast<ptrdiff_t>(s.length));
      }
    }
    return out;
  }

  // An archive with one fp32 tensor per storage, each storage made of `segments`.
  ArchiveOutput Archive(const std::string& path,
                        const std::vector<std::vector<Segment>>& storages) const {
    ArchiveOutput archive;
    archive.path = path;
    archive.archive_name = "archive";
    std::vector<pickle::Value*> tensors;
    for (size_t s = 0; s < storages.size(); ++s) {
      TensorNodeSpec spec;
      spec.storage_key = std::to_string(s);
      spec.storage_numel = SegmentBytes(storages[s]) / 4;
      spec.shape = {spec.storage_numel};
      tensors.push_back(MakeTensorNode(archive.graph, spec).value());
      archive.storages.push_back({spec.storage_key, storages[s]});
    }
    archive.graph.set_root(archive.graph.List(tensors));
    return archive;
  }

  // The same archive written from memory.
  void WriteExpectedArchive(const ArchiveOutput& archive, const std::string& path) const {
    TorchArchiveWriter::Options options;
    options.archive_name = archive.archive_name;
    options.sync = false;
    TorchArchiveWriter writer = TorchArchiveWriter::Create(path, options).value();
    std::vector<std::vector<std::byte>> data;
    for (const OutputStorage& storage : archive.storages) data.push_back(Bytes(storage.segments));
    for (size_t s = 0; s < data.size(); ++s) {
      ASSERT_TRUE(writer.AddStorageFromMemory(archive.storages[s].key, data[s]).ok());
    }
    ASSERT_TRUE(writer.Finish(archive.graph.root()).ok());
  }

  std::vector<std::string> OutEntries() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(root_ / "out")) {
      names.push_back(std::filesystem::relative(entry.path(), root_ / "out").string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  std::filesystem::path root_;
  std::vector<std::vector<std::byte>> sources_;
};

TEST_F(ExecutorTest, WritesEveryKindOfOutput) {
  const AtomIndex index = Index();
  const Atom& w = *index.Find("w", "fp32");
  const Atom& b = *index.Find("b", "exp_avg");
  std::vector<Segment> first =
      PlanRegion(index, w, Region::Flat(1500, 2600, w.shape).value()).value();
  AppendZeros(first, 40);
  std::vector<Segment> second = {{1, 10, 400}, {Segment::kZeroFill, 0, 8}, {2, 0, 4}};

  OutputPlan plan;
  plan.archives.push_back(Archive("a/b/rank0.pt", {first, second}));
  plan.archives.push_back(Archive("rank1.pt", {{{0, 4, 40}}}));
  SafetensorsOutput safetensors;
  safetensors.path = "st/model.safetensors";
  safetensors.metadata = {{"format", "pt"}};
  safetensors.tensors.push_back({"w", DType::kFloat32, w.shape,
                                 PlanRegion(index, w, Region::Whole(w.shape).value()).value()});
  std::vector<Segment> padded = PlanRegion(index, b, Region::Whole(b.shape).value()).value();
  AppendZeros(padded, 6);
  safetensors.tensors.push_back({"b", DType::kBFloat16, {3003}, padded});
  plan.safetensors.push_back(safetensors);
  plan.copies.push_back({"a/copy.bin", 1});
  plan.texts.push_back({"latest", "global_step5"});

  std::mutex mutex;
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  ExecuteOptions options;
  options.threads = 3;
  options.sync = false;
  options.chunk_bytes = 4096;
  options.progress = [&](uint64_t done, uint64_t total) {
    std::lock_guard lock(mutex);
    calls.emplace_back(done, total);
  };
  const Status status =
      ExecutePlan(plan, index, (root_ / "tag").string(), (root_ / "out").string(), options);
  ASSERT_TRUE(status.ok()) << status.ToString();

  for (const ArchiveOutput& archive : plan.archives) {
    WriteExpectedArchive(archive, Expected("x.pt"));
    EXPECT_EQ(ReadAll(Out(archive.path)), ReadAll(Expected("x.pt"))) << archive.path;
  }
  SafetensorsWriter expected;
  const std::vector<std::byte> w_bytes = Bytes(safetensors.tensors[0].segments);
  const std::vector<std::byte> b_bytes = Bytes(padded);
  ASSERT_TRUE(expected.AddFromMemory("w", DType::kFloat32, w.shape, w_bytes).ok());
  ASSERT_TRUE(expected.AddFromMemory("b", DType::kBFloat16, {3003}, b_bytes).ok());
  ASSERT_TRUE(expected.SetMetadata("format", "pt").ok());
  ASSERT_TRUE(expected.Write(Expected("x.safetensors")).ok());
  EXPECT_EQ(ReadAll(Out("st/model.safetensors")), ReadAll(Expected("x.safetensors")));
  EXPECT_EQ(ReadAll(Out("a/copy.bin")), ReadAll(Tag("src1.bin")));
  EXPECT_EQ(ReadAll(Out("latest")), "global_step5");
  EXPECT_EQ(OutEntries(),
            (std::vector<std::string>{"a", "a/b", "a/b/rank0.pt", "a/copy.bin", "latest",
                                      "rank1.pt", "st", "st/model.safetensors"}));

  const uint64_t total = plan.DataBytes() + sources_[1].size();
  EXPECT_EQ(plan.DataBytes(),
            SegmentBytes(first) + SegmentBytes(second) + 40 + 5000 * 4 + 3003 * 2);
  ASSERT_FALSE(calls.empty());
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].second, total);
    if (i > 0) {
      EXPECT_GT(calls[i].first, calls[i - 1].first);
    }
  }
  EXPECT_EQ(calls.back().first, total);
}

TEST_F(ExecutorTest, SyncedRunAndSingleThread) {
  const AtomIndex index = Index();
  OutputPlan plan;
  plan.archives.push_back(Archive("x/y/z.pt", {{{2, 0, 1'000'000}}}));
  plan.copies.push_back({"x/src0.bin", 0});
  ExecuteOptions options;
  options.threads = 1;
  ASSERT_TRUE(
      ExecutePlan(plan, index, (root_ / "tag").string(), (root_ / "out").string(), options).ok());
  WriteExpectedArchive(plan.archives[0], Expected("z.pt"));
  EXPECT_EQ(ReadAll(Out("x/y/z.pt")), ReadAll(Expected("z.pt")));
  EXPECT_EQ(ReadAll(Out("x/src0.bin")), ReadAll(Tag("src0.bin")));
}

// An archive built in parts, each part by its own call as other processes would, in an order
// that is not the archive's, one of them twice (a build taken over from a hung owner): the bytes
// are those ExecutePlan writes. Parts cut storages, a widened (bf16 → fp32) one included.
TEST_F(ExecutorTest, AnArchiveBuiltInPartsIsTheArchiveBuiltWhole) {
  const AtomIndex index = Index();
  std::vector<std::vector<Segment>> storages;
  for (uint64_t s = 0; s < 12; ++s) storages.push_back({{2, s * 20'000, 4'000 + s * 400}});
  storages[0] = {{2, 0, 900'000}};  // one storage holding most of the archive
  storages[5].push_back({Segment::kZeroFill, 0, 64});
  storages[7] = {{0, 1000, 40'000, true}, {2, 77, 4'000}};  // 20 000 bf16 widened, then fp32
  OutputPlan plan;
  plan.archives.push_back(Archive("model_states.pt", storages));
  plan.archives[0].archive_name.clear();  // named by its path's stem, as torch.save names it
  const ArchiveOutput& archive = plan.archives[0];
  ExecuteOptions options;
  options.sync = false;
  options.chunk_bytes = 1024;
  ASSERT_TRUE(
      ExecutePlan(plan, index, (root_ / "tag").string(), (root_ / "expected").string(), options)
          .ok());

  const std::vector<ArchivePart> parts = PlanArchiveParts(archive, 100'000).value();
  // Runs of the storages' bytes from 0 to the end, each at least 100 000 and less than twice.
  ASSERT_GE(parts.size(), 9u);
  EXPECT_EQ(parts.front().begin, 0u);
  EXPECT_EQ(parts.back().end, plan.DataBytes());
  for (size_t p = 0; p < parts.size(); ++p) {
    if (p > 0) {
      EXPECT_EQ(parts[p].begin, parts[p - 1].end);
    }
    EXPECT_GE(parts[p].end - parts[p].begin, 100'000u);
    EXPECT_LT(parts[p].end - parts[p].begin, 200'000u);
  }
  EXPECT_EQ(PlanArchiveParts(archive, uint64_t{1} << 40).value().size(), 1u);

  const std::string parts_path = Out(".model_states.pt.parts");
  const std::string tag = (root_ / "tag").string();
  const std::string out = (root_ / "out").string();
  std::vector<StoragePieceCrc> pieces;
  for (size_t p = parts.size(); p-- > 1;) {
    const std::vector<StoragePieceCrc> written =
        ExecuteArchivePart(archive, parts[p], index, tag, parts_path, options).value();
    pieces.insert(pieces.end(), written.begin(), written.end());
  }
  const Status early = FinishArchiveParts(archive, pieces, parts_path, out, options);
  EXPECT_EQ(early.code(), StatusCode::kFailedPrecondition) << early.ToString();
  EXPECT_THAT(early.message(), HasSubstr("storage 0 has 900000 bytes, its parts wrote [0, 0)"));
  EXPECT_FALSE(std::filesystem::exists(Out("model_states.pt")));
  for (const size_t p : {size_t{0}, size_t{1}}) {
    const std::vector<StoragePieceCrc> written =
        ExecuteArchivePart(archive, parts[p], index, tag, parts_path, options).value();
    pieces.insert(pieces.end(), written.begin(), written.end());
  }
  // Through the text a part's mark holds.
  const std::vector<StoragePieceCrc> parsed =
      ParsePieceCrcs(PieceCrcsText(pieces), "marks").value();
  EXPECT_EQ(parsed, pieces);
  ASSERT_TRUE(FinishArchiveParts(archive, parsed, parts_path, out, options).ok());
  EXPECT_TRUE(ReadAll(Out("model_states.pt")) == ReadAll(Expected("model_states.pt")));
  EXPECT_FALSE(std::filesystem::exists(parts_path));

  EXPECT_EQ(ParsePieceCrcs("0 0 64 0000000g\n", "m").status().code(), StatusCode::kCorrupt);
  EXPECT_THAT(ParsePieceCrcs("0 0 64\n", "mark m").status().message(),
              HasSubstr("mark m: line 1 \"0 0 64\" is not"));
  EXPECT_EQ(ExecuteArchivePart(archive, {0, plan.DataBytes() + 1}, index, tag, parts_path, options)
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  // A part's short source is found as the whole build finds it.
  std::filesystem::resize_file(Tag("src2.bin"), 999'000);
  EXPECT_EQ(ExecuteArchivePart(archive, parts[1], index, tag, parts_path, options).status().code(),
            StatusCode::kCorrupt);
}

// Counts the bytes ucp's own I/O reads from files whose path ends in `suffix`.
class ReadCounter : public IoFaultInjector {
 public:
  explicit ReadCounter(std::string suffix) : suffix_(std::move(suffix)) {}
  IoFault Decide(IoPhase, IoOp op, std::string_view path, size_t bytes) noexcept override {
    if (op == IoOp::kRead && path.ends_with(suffix_)) read_ += bytes;
    return {};
  }
  uint64_t read() const { return read_; }

 private:
  const std::string suffix_;
  std::atomic<uint64_t> read_{0};
};

// Fails or shortens the kernel copies of `record_bytes` (the copy of a whole record asks for all
// of it at once; no other write of the test is that large): `error`, else a tenth of the ask.
class CopyFault : public IoFaultInjector {
 public:
  CopyFault(uint64_t record_bytes, int error) : record_bytes_(record_bytes), error_(error) {}
  IoFault Decide(IoPhase, IoOp op, std::string_view, size_t bytes) noexcept override {
    if (op != IoOp::kWrite || bytes != record_bytes_ || fired_.exchange(1) != 0) return {};
    IoFault fault;
    if (error_ != 0) {
      fault.error = error_;
    } else {
      fault.max_bytes = bytes / 10;
    }
    return fault;
  }
  uint64_t fired() const { return fired_; }

 private:
  const uint64_t record_bytes_;
  const int error_;
  std::atomic<uint64_t> fired_{0};
};

// A source that is a torch archive: a storage that is one of its records, whole, moves with
// copy_file_range and keeps the record's CRC-32 from the source's directory, unread; a storage
// cut from a record is read and checked against the chunk hashes. Built whole or in parts.
TEST_F(ExecutorTest, ARecordCopiedUnchangedMovesUnseenWithItsSourceCrc) {
  const std::vector<std::byte> big = testing::Pattern(400'000, 7);
  const std::vector<std::byte> small = testing::Pattern(40'000, 8);
  {
    TorchArchiveWriter::Options options;
    options.sync = false;
    TorchArchiveWriter writer = TorchArchiveWriter::Create(Tag("src.pt"), options).value();
    ASSERT_TRUE(writer.AddStorageFromMemory("0", big).ok());
    ASSERT_TRUE(writer.AddStorageFromMemory("1", small).ok());
    pickle::Graph graph;
    TensorNodeSpec first;
    first.storage_key = "0";
    first.storage_numel = first.shape.emplace_back(big.size() / 4);
    TensorNodeSpec second;
    second.storage_key = "1";
    second.storage_numel = second.shape.emplace_back(small.size() / 4);
    graph.set_root(
        graph.List({MakeTensorNode(graph, first).value(), MakeTensorNode(graph, second).value()}));
    ASSERT_TRUE(writer.Finish(graph.root()).ok());
  }
  const ZipReader source = ZipReader::Open(Tag("src.pt")).value();
  const ZipRecord& whole = *source.Get("data/0").value();
  const ZipRecord& cut = *source.Get("data/1").value();
  const std::string file = ReadAll(Tag("src.pt"));
  AtomIndexContents contents;
  contents.framework = "test";
  contents.adapter = "test";
  contents.tag = "tag";
  ChunkedXxh3 hash(4096);
  hash.Update(file.data(), file.size());
  contents.files.push_back({"src.pt", file.size(), hash.Whole(), "data", {}, {}, hash.Chunks()});
  const AtomIndex index = AtomIndex::Create(std::move(contents)).value();
  OutputPlan plan;
  plan.archives.push_back(Archive(
      "out.pt", {{{0, whole.data_offset, whole.size}}, {{0, cut.data_offset, cut.size / 2}}}));
  const ArchiveOutput& archive = plan.archives[0];
  ExecuteOptions options;
  options.sync = false;
  options.chunk_bytes = 4096;
  const std::string tag = (root_ / "tag").string();
  ReadCounter reads("/src.pt");
  SetIoFaultInjector(&reads);
  const Status built = ExecutePlan(plan, index, tag, (root_ / "out").string(), options);
  SetIoFaultInjector(nullptr);
  ASSERT_TRUE(built.ok()) << built.ToString();
  // Bytes equal to the archive written from memory, its record CRCs included.
  {
    TorchArchiveWriter::Options writer_options;
    writer_options.archive_name = archive.archive_name;
    writer_options.sync = false;
    TorchArchiveWriter writer =
        TorchArchiveWriter::Create(Expected("out.pt"), writer_options).value();
    ASSERT_TRUE(writer.AddStorageFromMemory("0", big).ok());
    const std::span half(small.data(), small.size() / 2);
    ASSERT_TRUE(writer.AddStorageFromMemory("1", half).ok());
    ASSERT_TRUE(writer.Finish(archive.graph.root()).ok());
  }
  EXPECT_TRUE(ReadAll(Out("out.pt")) == ReadAll(Expected("out.pt")));
  // The whole record was not read: what was read is the cut record's checked chunks, the zip
  // headers and the directory's chunks, well under the whole record's 400 000 bytes.
  EXPECT_LT(reads.read(), whole.size / 2) << reads.read();
  const ZipReader written = ZipReader::Open(Out("out.pt")).value();
  EXPECT_EQ(written.Get("data/0").value()->crc32, whole.crc32);

  // In parts cutting the record: its pieces carry the record's CRC, the finished file is the same.
  const std::string parts_path = Out(".parts.pt");
  std::vector<StoragePieceCrc> pieces;
  const std::vector<ArchivePart> parts = PlanArchiveParts(archive, 100'000).value();
  for (const ArchivePart& part : parts) {
    const std::vector<StoragePieceCrc> written_part =
        ExecuteArchivePart(archive, part, index, tag, parts_path, options).value();
    pieces.insert(pieces.end(), written_part.begin(), written_part.end());
  }
  ASSERT_GE(pieces.size(), 4u);
  for (const StoragePieceCrc& piece : pieces) {
    EXPECT_EQ(piece.record_crc, piece.key == "0") << piece.key << " " << piece.offset;
    if (piece.record_crc) {
      EXPECT_EQ(piece.crc32, whole.crc32);
    }
  }
  const std::vector<StoragePieceCrc> parsed =
      ParsePieceCrcs(PieceCrcsText(pieces), "marks").value();
  EXPECT_EQ(parsed, pieces);
  std::filesystem::create_directories(root_ / "parts");
  ASSERT_TRUE(
      FinishArchiveParts(archive, parsed, parts_path, (root_ / "parts").string(), options).ok());
  EXPECT_TRUE(ReadAll((root_ / "parts" / "out.pt").string()) == ReadAll(Expected("out.pt")));
  // Pieces of one storage from a record copy and through memory: not one build's.
  std::vector<StoragePieceCrc> mixed = pieces;
  mixed.front().record_crc = !mixed.front().record_crc;
  const Status mix =
      FinishArchiveParts(archive, mixed, parts_path, (root_ / "parts").string(), options);
  EXPECT_EQ(mix.code(), StatusCode::kFailedPrecondition) << mix.ToString();

  // The kernel copy moving less than asked, or refusing (EXDEV: another file system; the copy
  // falls back to reads and writes), gives the same file; ENOSPC fails and leaves nothing.
  for (const int error : {0, EXDEV, ENOSPC}) {
    CopyFault fault(whole.size, error);
    SetIoFaultInjector(&fault);
    std::filesystem::remove(Out("out.pt"));
    const Status status = ExecutePlan(plan, index, tag, (root_ / "out").string(), options);
    SetIoFaultInjector(nullptr);
    EXPECT_GT(fault.fired(), 0u) << error;
    if (error == ENOSPC) {
      EXPECT_EQ(status.code(), StatusCode::kIoError) << status.ToString();
      EXPECT_THAT(status.message(), HasSubstr("copy_file_range"));
      EXPECT_EQ(OutEntries(), std::vector<std::string>{}) << error;
    } else {
      ASSERT_TRUE(status.ok()) << error << " " << status.ToString();
      EXPECT_TRUE(ReadAll(Out("out.pt")) == ReadAll(Expected("out.pt"))) << error;
    }
  }

  // Damage in the copied record is not seen here: its source CRC travels with it, so the copy
  // fails the CRC check torch's or ucp's verifying readers make.
  const auto damage = [&](uint64_t at) {
    std::string bytes = file;
    bytes[at] = static_cast<char>(bytes[at] ^ 1);
    std::ofstream(Tag("src.pt"), std::ios::binary).write(bytes.data(), bytes.size());
  };
  damage(whole.data_offset + 1000);
  std::filesystem::remove(Out("out.pt"));
  ASSERT_TRUE(ExecutePlan(plan, index, tag, (root_ / "out").string(), options).ok());
  const ZipReader damaged = ZipReader::Open(Out("out.pt")).value();
  EXPECT_EQ(damaged.VerifyCrc(*damaged.Get("data/0").value()).code(), StatusCode::kCorrupt);
  // Damage in the bytes read, or in the directory the CRCs come from (the "version made by" of
  // its first entry, which the zip reader does not look at): kCorrupt, nothing written.
  const size_t directory = file.find("PK\1\2", cut.data_offset + cut.size);
  ASSERT_NE(directory, std::string::npos);
  for (const uint64_t at : {cut.data_offset + 10, directory + 4}) {
    damage(at);
    std::filesystem::remove(Out("out.pt"));
    const Status status = ExecutePlan(plan, index, tag, (root_ / "out").string(), options);
    EXPECT_EQ(status.code(), StatusCode::kCorrupt) << at << " " << status.ToString();
    EXPECT_FALSE(std::filesystem::exists(Out("out.pt")));
  }
}

TEST_F(ExecutorTest, ShortSourceIsCorruptAndNothingIsWritten) {
  const AtomIndex index = Index();
  std::filesystem::resize_file(Tag("src2.bin"), 999'000);
  OutputPlan plan;
  plan.texts.push_back({"latest", "x"});
  plan.archives.push_back(Archive("dir/rank0.pt", {{{2, 0, 400}}}));
  ExecuteOptions options;
  options.sync = false;
  const Status status =
      ExecutePlan(plan, index, (root_ / "tag").string(), (root_ / "out").string(), options);
  EXPECT_EQ(status.code(), StatusCode::kCorrupt);
  EXPECT_THAT(status.message(), HasSubstr(Tag("src2.bin") + " has 999000 bytes, the index says "
                                                            "1000003"));
  EXPECT_TRUE(OutEntries().empty());

  std::filesystem::remove(Tag("src2.bin"));
  EXPECT_EQ(
      ExecutePlan(plan, index, (root_ / "tag").string(), (root_ / "out").string(), options).code(),
      StatusCode::kNotFound);
  EXPECT_TRUE(OutEntries().empty());
}

TEST_F(ExecutorTest, BadPlansAreRejectedBeforeWriting) {
  const AtomIndex index = Index();
  ExecuteOptions options;
  options.sync = false;
  const auto run = [&](OutputPlan plan) {
    plan.texts.push_back({"latest", "x"});
    return ExecutePlan(plan, index, (root_ / "tag").string(), (root_ / "out").string(), options);
  };
  for (const std::string bad : {"../escape.pt", "/abs.pt", "a/./b.pt", "a//b.pt", "", "dir/"}) {
    OutputPlan plan;
    plan.archives.push_back(Archive(bad, {{{0, 0, 4}}}));
    const Status status = run(std::move(plan));
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(status.message(), HasSubstr("\"" + bad + "\" is not a normalised path")) << bad;
  }
  OutputPlan twice;
  twice.copies.push_back({"latest", 0});
  EXPECT_THAT(run(std::move(twice)).message(), HasSubstr("\"latest\" is planned twice"));
  OutputPlan outside;
  outside.archives.push_back(Archive("r.pt", {{{1, 4990, 12}}}));
  EXPECT_THAT(run(std::move(outside)).message(),
              HasSubstr("r.pt storage 0: segment [4990, +12) is outside src1.bin (5000 bytes)"));
  OutputPlan no_file;
  no_file.copies.push_back({"c.bin", 3});
  EXPECT_EQ(run(std::move(no_file)).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(OutEntries().empty());
}

TEST_F(ExecutorTest, SafetensorsExportShardsAndIndex) {
  const AtomIndex index = Index();
  // w is 20000 bytes, b 6000: a 21000-byte limit puts them in two shards.
  const OutputPlan sharded = PlanSafetensorsExport(index, "fp32", 21'000).value();
  ASSERT_EQ(sharded.safetensors.size(), 2u);
  EXPECT_EQ(sharded.safetensors[0].path, "model-00001-of-00002.safetensors");
  EXPECT_EQ(sharded.safetensors[1].path, "model-00002-of-00002.safetensors");
  ASSERT_EQ(sharded.texts.size(), 1u);
  EXPECT_EQ(sharded.texts[0].path, "model.safetensors.index.json");
  ASSERT_TRUE(ExecutePlan(sharded, index, (root_ / "tag").string(), (root_ / "out").string(),
                          ExecuteOptions{})
                  .ok());
  const SafetensorsShardedReader reader =
      SafetensorsShardedReader::Open(Out("model.safetensors.index.json")).value();
  EXPECT_EQ(reader.index().total_size, 26'000u);
  EXPECT_EQ(reader.index().weight_map.at("w"), "model-00001-of-00002.safetensors");
  EXPECT_EQ(reader.index().weight_map.at("b"), "model-00002-of-00002.safetensors");
  for (const std::string param : {"w", "b"}) {
    const Atom& atom = *index.Find(param, "fp32");
    const SafetensorsShardedReader::Located found = reader.Find(param).value();
    EXPECT_EQ(found.tensor->dtype, atom.dtype);
    EXPECT_EQ(found.tensor->shape, atom.shape);
    const std::string file = ReadAll(*found.file);
    const std::vector<std::byte> bytes =
        Bytes(PlanRegion(index, atom, Region::Whole(atom.shape).value()).value());
    ASSERT_EQ(found.tensor->size, bytes.size());
    EXPECT_EQ(0, std::memcmp(file.data() + found.tensor->offset, bytes.data(), bytes.size()));
  }

  const OutputPlan single = PlanSafetensorsExport(index, "exp_avg", 0).value();
  ASSERT_EQ(single.safetensors.size(), 1u);
  EXPECT_EQ(single.safetensors[0].path, "model.safetensors");
  ASSERT_EQ(single.safetensors[0].tensors.size(), 2u);
  EXPECT_EQ(single.safetensors[0].tensors[0].name, "w");
  EXPECT_EQ(single.safetensors[0].metadata.at("format"), "pt");

  const Status missing = PlanSafetensorsExport(index, "exp_avg_sq", 0).status();
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("no atom has that state (states: exp_avg, fp32)"));
}

}  // namespace
}  // namespace ucp
