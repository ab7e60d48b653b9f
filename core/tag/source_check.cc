#include "core/tag/source_check.h"

#include <algorithm>
#include <memory>
#include <set>
#include <utility>

#include "core/format/dtype.h"
#include "core/format/zip_reader.h"
#include "core/io/checked_source.h"
#include "core/io/file.h"
#include "core/tag/file_hashing.h"
#include "core/tag/journal.h"

namespace ucp {

std::vector<uint32_t> FilesRead(const AtomIndex& index, const OutputPlan& plan) {
  std::set<uint32_t> files;
  const auto add_segments = [&](const std::vector<Segment>& segments) {
    for (const Segment& segment : segments) {
      if (!segment.zero_fill()) files.insert(segment.file);
    }
  };
  for (const ArchiveOutput& archive : plan.archives) {
    for (const OutputStorage& storage : archive.storages) add_segments(storage.segments);
  }
  for (const SafetensorsOutput& output : plan.safetensors) {
    for (const SafetensorsOutputTensor& tensor : output.tensors) add_segments(tensor.segments);
  }
  for (const CopyOutput& copy : plan.copies) files.insert(copy.file);
  for (const CarriedObject& carried : index.contents().carried) files.insert(carried.file);
  return {files.begin(), files.end()};
}

std::string LocateDamage(const AtomIndex& index, uint32_t file, const std::string& tag_dir,
                         uint64_t begin, uint64_t end) {
  if (index.files()[file].role == kStoreAtomsRole) return "";
  Result<File> opened = File::OpenBeneath(tag_dir, index.files()[file].path);
  if (!opened.ok()) return "";
  Result<ZipReader> zip = ZipReader::Open(std::move(opened).value(), ZipReader::Limits{});
  if (!zip.ok()) return "its zip structure: " + zip.status().message();
  std::string found;
  for (const ZipRecord& record : zip->records()) {
    if (record.data_offset >= end || record.data_offset + record.size <= begin) continue;
    const Status crc = zip->VerifyCrc(record);
    if (crc.ok()) continue;
    if (crc.code() != StatusCode::kCorrupt) return found.empty() ? crc.message() : found;
    std::string held =
        AtomsWithin(index, file, record.data_offset, record.data_offset + record.size);
    if (held.empty() && record.name.ends_with("data.pkl")) held = "the pickle";
    found += (found.empty() ? "" : "; ") + std::string("record ") + record.name +
             " fails its CRC-32" + (held.empty() ? "" : " (it holds " + held + ")");
  }
  return found;
}

DamageLocator LocateDamageWith(const AtomIndex& index, const std::string& tag_dir) {
  return [&index, tag_dir](uint32_t file, uint64_t begin, uint64_t end) {
    const std::string located = LocateDamage(index, file, tag_dir, begin, end);
    if (!located.empty()) return located;
    const std::string held = AtomsWithin(index, file, begin, end);
    return held.empty() ? held : "they hold " + held;
  };
}

Status VerifySources(const AtomIndex& index, const std::vector<uint32_t>& files,
                     const std::string& tag_dir, std::string_view who) {
  std::vector<std::string> paths;
  paths.reserve(files.size());
  for (const uint32_t file : files) paths.push_back(index.files()[file].path);
  HashOptions options;
  options.trust_journal = false;
  UCP_ASSIGN_OR_RETURN(std::vector<FileDigest> digests, HashTagFiles(tag_dir, paths, options));
  for (size_t i = 0; i < digests.size(); ++i) {
    const IndexedFile& indexed = index.files()[files[i]];
    std::string differs;
    if (digests[i].size != indexed.size) {
      differs = std::to_string(digests[i].size) + " bytes, the index says " +
                std::to_string(indexed.size);
    } else if (digests[i].xxh3 != indexed.xxh3) {
      differs =
          "XXH3 " + FormatXxh3(digests[i].xxh3) + ", the index says " + FormatXxh3(indexed.xxh3);
    } else {
      continue;
    }
    const std::string where = LocateDamage(index, files[i], tag_dir);
    return Status::Corrupt(std::string(who) + ": source " + tag_dir + "/" + indexed.path + " has " +
                           differs + (where.empty() ? "" : ": " + where));
  }
  return Status::Ok();
}

namespace {

// Checks the chunks of carried archive `file` that hold what planning read from it: every pickle
// record and the zip directory (from the end of the last record's data to the end of the file).
Status CheckArchiveStructure(const AtomIndex& index, uint32_t file, const std::string& tag_dir,
                             std::string_view who) {
  const IndexedFile& indexed = index.files()[file];
  UCP_ASSIGN_OR_RETURN(File opened, File::OpenBeneath(tag_dir, indexed.path));
  UCP_ASSIGN_OR_RETURN(const uint64_t size, opened.Size());
  if (size != indexed.size) {
    return Status::Corrupt(std::string(who) + ": source " + opened.path() + " has " +
                           std::to_string(size) + " bytes, the index says " +
                           std::to_string(indexed.size));
  }
  const std::string opened_path = opened.path();
  Result<ZipReader> zip = ZipReader::Open(std::move(opened), ZipReader::Limits{});
  if (!zip.ok()) {
    return Status::Corrupt(std::string(who) + ": source " + opened_path +
                           ": its zip structure: " + zip.status().message());
  }
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // [begin, end)
  uint64_t data_end = 0;
  for (const ZipRecord& record : zip->records()) {
    data_end = std::max(data_end, record.data_offset + record.size);
    if (record.name.ends_with(".pkl")) {
      ranges.emplace_back(record.data_offset, record.data_offset + record.size);
    }
  }
  ranges.emplace_back(data_end, size);
  const DamageLocator locate = LocateDamageWith(index, tag_dir);
  const CheckedSource checked(zip->file(), size, indexed.chunks, [&](uint64_t begin, uint64_t end) {
    return locate(file, begin, end);
  });
  ChunkCache cache;
  constexpr size_t kBuffer = size_t{256} << 10;
  std::unique_ptr<std::byte[]> buffer(new std::byte[kBuffer]);
  for (const auto& [begin, end] : ranges) {
    for (uint64_t at = begin; at < end;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(end - at, kBuffer));
      const Status read = checked.ReadAt(at, std::span(buffer.get(), n), cache);
      if (!read.ok()) return read.WithContext(std::string(who));
      at += n;
    }
  }
  return Status::Ok();
}

}  // namespace

Status CheckSourcesBeforeReading(const AtomIndex& index, const OutputPlan& plan,
                                 const std::string& tag_dir, std::string_view who) {
  std::vector<uint32_t> whole;
  for (const uint32_t file : FilesRead(index, plan)) {
    if (!index.files()[file].chunks.recorded()) whole.push_back(file);
  }
  UCP_RETURN_IF_ERROR(VerifySources(index, whole, tag_dir, who));
  std::set<uint32_t> carried;
  for (const CarriedObject& object : index.contents().carried) {
    if (index.files()[object.file].chunks.recorded()) carried.insert(object.file);
  }
  for (const uint32_t file : carried) {
    UCP_RETURN_IF_ERROR(CheckArchiveStructure(index, file, tag_dir, who));
  }
  return Status::Ok();
}

}  // namespace ucp
