#include "core/tag/source_check.h"

#include <set>
#include <utility>

#include "core/format/dtype.h"
#include "core/format/zip_reader.h"
#include "core/io/file.h"
#include "core/tag/file_hashing.h"
#include "core/tag/journal.h"

namespace ucp {
namespace {

// Enough names to find the damage; the rest are counted.
constexpr size_t kMaxNamedAtoms = 4;

// The atoms with bytes in [begin, end) of file `file`: "exp_avg of wte.weight, ...".
std::string AtomsWithin(const AtomIndex& index, uint32_t file, uint64_t begin, uint64_t end) {
  std::vector<std::string> names;
  for (const Atom& atom : index.atoms()) {
    for (const Fragment& fragment : atom.fragments) {
      const uint64_t length = fragment.region.numel() * ItemSize(fragment.dtype);
      if (fragment.file == file && fragment.offset < end && begin < fragment.offset + length) {
        names.push_back(atom.state + " of " + atom.param);
        break;
      }
    }
  }
  std::string out;
  for (size_t i = 0; i < names.size() && i < kMaxNamedAtoms; ++i) {
    out += (i == 0 ? "" : ", ") + names[i];
  }
  if (names.size() > kMaxNamedAtoms) {
    out += " and " + std::to_string(names.size() - kMaxNamedAtoms) + " more";
  }
  return out;
}

}  // namespace

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

std::string LocateDamage(const AtomIndex& index, uint32_t file, const std::string& tag_dir) {
  if (index.files()[file].role == kStoreAtomsRole) return "";
  Result<File> opened = File::OpenBeneath(tag_dir, index.files()[file].path);
  if (!opened.ok()) return "";
  Result<ZipReader> zip = ZipReader::Open(std::move(opened).value(), ZipReader::Limits{});
  if (!zip.ok()) return "its zip structure: " + zip.status().message();
  std::string found;
  for (const ZipRecord& record : zip->records()) {
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

}  // namespace ucp
