// Helpers of the DeepSpeed adapter tests: bytes of files, segments and tensors, pickle renderings,
// scratch directories.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/format/atom_index.h"
#include "core/format/pickle_value.h"
#include "core/format/torch_archive_reader.h"
#include "core/frameworks/framework_adapter.h"
#include "core/io/file.h"
#include "core/plan/copy_plan.h"
#include "core/plan/executor.h"

namespace ucp::deepspeed_testing {

// `length` bytes at `offset` of the file at `path` (a failure fails the test).
inline std::string ReadBytes(const std::string& path, uint64_t offset, uint64_t length) {
  Result<File> file = File::Open(path, File::Mode::kRead);
  EXPECT_TRUE(file.ok()) << file.status().ToString();
  if (!file.ok()) return {};
  std::string bytes(length, '\0');
  const Status status =
      file->ReadAt(offset, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()});
  EXPECT_TRUE(status.ok()) << status.ToString();
  return bytes;
}

// The bytes `segments` stand for, read from the index's files under `tag_dir`.
inline std::string SegmentBytes(const AtomIndex& index, const std::string& tag_dir,
                                const std::vector<Segment>& segments) {
  std::string out;
  for (const Segment& segment : segments) {
    if (segment.zero_fill()) {
      out.append(segment.length, '\0');
    } else {
      out += ReadBytes(tag_dir + "/" + index.files()[segment.file].path, segment.offset,
                       segment.length);
    }
  }
  return out;
}

// A tensor's own elements as stored in its archive (tensors here are contiguous).
inline std::string TensorBytes(const TorchArchiveReader& reader, const TorchTensor& tensor) {
  EXPECT_TRUE(tensor.contiguous());
  return ReadBytes(reader.path(), tensor.file_offset(), tensor.byte_size());
}

// pickle::Render of `node` (a failure fails the test).
inline std::string RenderOf(const pickle::Value* node) {
  Result<std::string> text = pickle::Render(node);
  EXPECT_TRUE(text.ok()) << text.status().ToString();
  return text.ok() ? *text : "";
}

// A tensor node without its storage key (DeepSpeed's key numbering follows the order in which
// it happened to restore the state dict): storage class, location, storage size, offset, shape,
// stride, requires_grad.
inline std::string TensorMeta(const pickle::Value* tensor) {
  const pickle::Value* pid = tensor->args()->Item(0)->pid();
  // Appended piece by piece: g++ 12 at -O3 warns falsely (-Wrestrict) on `" " + string`.
  std::string meta = RenderOf(pid->Item(1));
  for (const pickle::Value* part : {pid->Item(3), pid->Item(4)})
    meta.append(" ").append(RenderOf(part));
  for (size_t i = 1; i <= 4; ++i) meta.append(" ").append(RenderOf(tensor->args()->Item(i)));
  return meta;
}

// The storage key of a tensor node built by MakeTensorNode / torch.save.
inline std::string StorageKey(const pickle::Value* tensor) {
  const pickle::Value* pid = tensor->args()->Item(0);
  return pid->pid()->Item(2)->data();
}

// Tests need no durability: no fsync.
inline ExecuteOptions NoSync() {
  ExecuteOptions options;
  options.sync = false;
  return options;
}

// A temporary directory, removed afterwards.
class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/ucp_deepspeed_test.XXXXXX";
    path_ = ::mkdtemp(pattern) == nullptr ? "" : pattern;
  }
  ~TempDir() {
    if (!path_.empty()) std::filesystem::remove_all(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A writable copy of the (read-only) tag directory `source` at `destination`.
inline void WritableCopy(const std::string& source, const std::string& destination) {
  namespace fs = std::filesystem;
  fs::copy(source, destination);
  for (const fs::directory_entry& entry : fs::directory_iterator(destination)) {
    fs::permissions(entry.path(), fs::perms::owner_read | fs::perms::owner_write);
  }
}

// With file `name` of `tag` replaced by the same-named file of `other_tag`, BuildIndex fails as
// corrupt, naming the file and `field`.
inline void ExpectFileOfAnotherSaveNamed(const FrameworkAdapter& adapter, const std::string& tag,
                                         const std::string& other_tag, const std::string& name,
                                         const std::string& field) {
  std::filesystem::copy_file(other_tag + "/" + name, tag + "/" + name,
                             std::filesystem::copy_options::overwrite_existing);
  const Status status = adapter.BuildIndex(tag, {}).status();
  EXPECT_EQ(status.code(), StatusCode::kCorrupt) << status.ToString();
  EXPECT_THAT(status.message(), ::testing::HasSubstr(name));
  EXPECT_THAT(status.message(), ::testing::HasSubstr(field));
}

// The universal export `adapter` plans for `tag` from `index` (written to and read back from
// JSON first) names the files of DeepSpeed's ds_to_universal output `universal`, each archive
// with the same object tree.
inline void ExpectExportPlanLikeDsToUniversal(const FrameworkAdapter& adapter,
                                              const AtomIndex& index, const std::string& tag,
                                              const std::string& universal) {
  namespace fs = std::filesystem;
  Result<AtomIndex> reread = AtomIndex::Parse(index.ToJson(), "index.json");
  ASSERT_TRUE(reread.ok()) << reread.status().ToString();
  EXPECT_EQ(reread->ToJson(), index.ToJson());
  Result<OutputPlan> plan = adapter.PlanUniversalExport(*reread, tag);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  std::set<std::string> oracle_files;
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(universal)) {
    if (entry.is_regular_file()) {
      oracle_files.insert(fs::relative(entry.path(), universal).string());
    }
  }
  std::set<std::string> planned;
  for (const ArchiveOutput& archive : plan->archives) {
    planned.insert(archive.path);
    Result<TorchArchiveReader> oracle = TorchArchiveReader::Open(universal + "/" + archive.path);
    ASSERT_TRUE(oracle.ok()) << oracle.status().ToString();
    EXPECT_EQ(RenderOf(archive.graph.root()), RenderOf(oracle->root())) << archive.path;
  }
  for (const CopyOutput& copy : plan->copies) planned.insert(copy.path);
  EXPECT_EQ(planned, oracle_files);
}

// Every file `plan` wrote into `out_dir` has the size computed for it without writing
// (PlannedArchiveSize, PlannedFileSize): what a view answers `stat` with before it builds.
inline void ExpectPlannedSizes(const OutputPlan& plan, const AtomIndex& index,
                               const std::string& out_dir) {
  for (const ArchiveOutput& archive : plan.archives) {
    const Result<uint64_t> size = PlannedArchiveSize(archive);
    ASSERT_TRUE(size.ok()) << archive.path << ": " << size.status().ToString();
    EXPECT_EQ(*size, std::filesystem::file_size(out_dir + "/" + archive.path)) << archive.path;
  }
  const auto expect_single = [&](const OutputPlan& single, const std::string& path) {
    const Result<std::optional<uint64_t>> size = PlannedFileSize(single, index);
    ASSERT_TRUE(size.ok() && size->has_value()) << path;
    EXPECT_EQ(**size, std::filesystem::file_size(out_dir + "/" + path)) << path;
  };
  for (const CopyOutput& copy : plan.copies) {
    OutputPlan single;
    single.copies.push_back(copy);
    expect_single(single, copy.path);
  }
  for (const TextOutput& text : plan.texts) {
    OutputPlan single;
    single.texts.push_back(text);
    expect_single(single, text.path);
  }
}

}  // namespace ucp::deepspeed_testing
