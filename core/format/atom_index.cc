#include "core/format/atom_index.h"

#include <algorithm>
#include <filesystem>
#include <initializer_list>
#include <set>
#include <utility>

#include <xxhash.h>

#include "core/io/file.h"
#include "core/util/checked.h"
#include "core/util/path.h"

namespace ucp {
namespace {

// Enough names to find damage with; the rest are counted.
constexpr size_t kMaxNamedAtoms = 4;

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

std::string Member(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

std::string Element(const std::string& path, size_t i) {
  return path + "[" + std::to_string(i) + "]";
}

std::string HexXxh3(uint64_t value) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, value >>= 4) out[static_cast<size_t>(i)] = kDigits[value & 15];
  return out;
}

std::optional<uint64_t> ParseXxh3(std::string_view text) {
  if (text.size() != 16) return std::nullopt;
  uint64_t value = 0;
  for (const char c : text) {
    uint64_t digit;
    if (c >= '0' && c <= '9') {
      digit = static_cast<uint64_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      digit = static_cast<uint64_t>(c - 'a' + 10);
    } else {
      return std::nullopt;
    }
    value = value << 4 | digit;
  }
  return value;
}

// Reads the members of a parsed document, every error naming the source and the field path.
class DocumentReader {
 public:
  explicit DocumentReader(const std::string& source) : source_(source) {}

  Status Error(const std::string& path, const std::string& what) const {
    return Status::Corrupt("atom index " + source_ + ": " + (path.empty() ? "" : path + ": ") +
                           what);
  }

  // `value` must be an object holding only `allowed` members.
  Status Object(const Json& value, const std::string& path,
                std::initializer_list<std::string_view> allowed) const {
    if (!value.is_object()) return Error(path, "not an object");
    for (const auto& [key, member] : value.items()) {
      bool known = false;
      for (const std::string_view name : allowed) known = known || key == name;
      if (!known) return Error(Member(path, key), "unknown member");
    }
    return Status::Ok();
  }

  Result<const Json*> Get(const Json& object, const std::string& path, std::string_view key) const {
    const auto it = object.find(key);
    if (it == object.end()) return Error(Member(path, key), "missing");
    return &*it;
  }

  Result<uint64_t> U64(const Json& value, const std::string& path) const {
    if (!value.is_number_unsigned()) return Error(path, "not a non-negative integer");
    return value.get<uint64_t>();
  }
  Result<uint64_t> U64(const Json& object, const std::string& path, std::string_view key) const {
    UCP_ASSIGN_OR_RETURN(const Json* value, Get(object, path, key));
    return U64(*value, Member(path, key));
  }

  Result<uint32_t> U32(const Json& object, const std::string& path, std::string_view key) const {
    UCP_ASSIGN_OR_RETURN(const uint64_t value, U64(object, path, key));
    if (value > UINT32_MAX) return Error(Member(path, key), "exceeds 32 bits");
    return static_cast<uint32_t>(value);
  }

  Result<std::string> String(const Json& value, const std::string& path) const {
    if (!value.is_string()) return Error(path, "not a string");
    return value.get<std::string>();
  }
  Result<std::string> String(const Json& object, const std::string& path,
                             std::string_view key) const {
    UCP_ASSIGN_OR_RETURN(const Json* value, Get(object, path, key));
    return String(*value, Member(path, key));
  }

  Result<const Json*> Array(const Json& object, const std::string& path,
                            std::string_view key) const {
    UCP_ASSIGN_OR_RETURN(const Json* value, Get(object, path, key));
    if (!value->is_array()) return Error(Member(path, key), "not an array");
    return value;
  }

  Result<std::vector<uint64_t>> U64Array(const Json& object, const std::string& path,
                                         std::string_view key) const {
    UCP_ASSIGN_OR_RETURN(const Json* array, Array(object, path, key));
    std::vector<uint64_t> out;
    out.reserve(array->size());
    for (size_t i = 0; i < array->size(); ++i) {
      UCP_ASSIGN_OR_RETURN(const uint64_t value, U64((*array)[i], Element(Member(path, key), i)));
      out.push_back(value);
    }
    return out;
  }

  Result<DType> Dtype(const Json& object, const std::string& path) const {
    UCP_ASSIGN_OR_RETURN(const std::string name, String(object, path, "dtype"));
    const std::optional<DType> dtype = DTypeFromTorchName(name);
    if (!dtype) return Error(Member(path, "dtype"), "unknown dtype \"" + name + "\"");
    return *dtype;
  }

 private:
  const std::string& source_;
};

Result<IndexedFile> ReadFileEntry(const DocumentReader& doc, const Json& value,
                                  const std::string& path, uint64_t version) {
  if (version >= 3) {
    UCP_RETURN_IF_ERROR(doc.Object(
        value, path, {"path", "size", "xxh3", "role", "rank", "copy_of", "chunk_bytes", "chunks"}));
  } else if (version >= 2) {
    UCP_RETURN_IF_ERROR(
        doc.Object(value, path, {"path", "size", "xxh3", "role", "rank", "copy_of"}));
  } else {
    UCP_RETURN_IF_ERROR(doc.Object(value, path, {"path", "size", "xxh3", "role", "rank"}));
  }
  IndexedFile file;
  UCP_ASSIGN_OR_RETURN(file.path, doc.String(value, path, "path"));
  UCP_ASSIGN_OR_RETURN(file.size, doc.U64(value, path, "size"));
  UCP_ASSIGN_OR_RETURN(const std::string hex, doc.String(value, path, "xxh3"));
  const std::optional<uint64_t> xxh3 = ParseXxh3(hex);
  if (!xxh3) return doc.Error(Member(path, "xxh3"), "not 16 lower-case hex digits");
  file.xxh3 = *xxh3;
  UCP_ASSIGN_OR_RETURN(file.role, doc.String(value, path, "role"));
  if (value.contains("rank")) {
    const std::string rank_path = Member(path, "rank");
    const Json& rank = value["rank"];
    UCP_RETURN_IF_ERROR(doc.Object(rank, rank_path, {"dp", "tp", "pp"}));
    RankCoordinates coordinates;
    UCP_ASSIGN_OR_RETURN(coordinates.dp, doc.U32(rank, rank_path, "dp"));
    UCP_ASSIGN_OR_RETURN(coordinates.tp, doc.U32(rank, rank_path, "tp"));
    UCP_ASSIGN_OR_RETURN(coordinates.pp, doc.U32(rank, rank_path, "pp"));
    file.rank = coordinates;
  }
  if (value.contains("copy_of")) {
    UCP_ASSIGN_OR_RETURN(file.copy_of, doc.U32(value, path, "copy_of"));
  }
  Result<ChunkHashes> chunks = ChunkHashesFromJson(value, file.size);
  if (!chunks.ok()) return doc.Error(Member(path, "chunks"), chunks.status().message());
  file.chunks = std::move(chunks).value();
  return file;
}

// Reads a region of an atom of `shape`. Bounds are the region's own validation, reported at the
// region's path.
Result<Region> ReadRegion(const DocumentReader& doc, const Json& value, const std::string& path,
                          const Shape& shape) {
  UCP_RETURN_IF_ERROR(doc.Object(value, path, {"flat", "box"}));
  if (value.size() != 1) return doc.Error(path, "needs exactly one of \"flat\" and \"box\"");
  if (value.contains("flat")) {
    UCP_ASSIGN_OR_RETURN(const std::vector<uint64_t> range, doc.U64Array(value, path, "flat"));
    if (range.size() != 2) return doc.Error(Member(path, "flat"), "not [begin, end]");
    Result<Region> region = Region::Flat(range[0], range[1], shape);
    if (!region.ok()) return doc.Error(path, region.status().message());
    return std::move(region).value();
  }
  const std::string box_path = Member(path, "box");
  const Json& box = value["box"];
  UCP_RETURN_IF_ERROR(doc.Object(box, box_path, {"offsets", "extents"}));
  UCP_ASSIGN_OR_RETURN(std::vector<uint64_t> offsets, doc.U64Array(box, box_path, "offsets"));
  UCP_ASSIGN_OR_RETURN(std::vector<uint64_t> extents, doc.U64Array(box, box_path, "extents"));
  Result<Region> region = Region::Box(std::move(offsets), std::move(extents), shape);
  if (!region.ok()) return doc.Error(path, region.status().message());
  return std::move(region).value();
}

Result<Atom> ReadAtom(const DocumentReader& doc, const Json& value, const std::string& path,
                      uint64_t version) {
  if (version >= 2) {
    UCP_RETURN_IF_ERROR(
        doc.Object(value, path, {"param", "state", "dtype", "shape", "fragments", "consolidated"}));
  } else {
    UCP_RETURN_IF_ERROR(doc.Object(value, path, {"param", "state", "dtype", "shape", "fragments"}));
  }
  Atom atom;
  UCP_ASSIGN_OR_RETURN(atom.param, doc.String(value, path, "param"));
  UCP_ASSIGN_OR_RETURN(atom.state, doc.String(value, path, "state"));
  UCP_ASSIGN_OR_RETURN(atom.dtype, doc.Dtype(value, path));
  UCP_ASSIGN_OR_RETURN(atom.shape, doc.U64Array(value, path, "shape"));
  if (const Result<uint64_t> numel = NumElements(atom.shape); !numel.ok()) {
    return doc.Error(Member(path, "shape"), numel.status().message());
  }
  UCP_ASSIGN_OR_RETURN(const Json* fragments, doc.Array(value, path, "fragments"));
  for (size_t i = 0; i < fragments->size(); ++i) {
    const std::string fragment_path = Element(Member(path, "fragments"), i);
    const Json& item = (*fragments)[i];
    UCP_RETURN_IF_ERROR(doc.Object(item, fragment_path, {"file", "offset", "dtype", "region"}));
    UCP_ASSIGN_OR_RETURN(const uint32_t file, doc.U32(item, fragment_path, "file"));
    UCP_ASSIGN_OR_RETURN(const uint64_t offset, doc.U64(item, fragment_path, "offset"));
    UCP_ASSIGN_OR_RETURN(const DType dtype, doc.Dtype(item, fragment_path));
    UCP_ASSIGN_OR_RETURN(const Json* region_json, doc.Get(item, fragment_path, "region"));
    UCP_ASSIGN_OR_RETURN(
        Region region, ReadRegion(doc, *region_json, Member(fragment_path, "region"), atom.shape));
    atom.fragments.push_back(Fragment{file, offset, dtype, std::move(region)});
  }
  if (value.contains("consolidated")) {
    const std::string copy_path = Member(path, "consolidated");
    const Json& copy = value["consolidated"];
    UCP_RETURN_IF_ERROR(doc.Object(copy, copy_path, {"file", "offset"}));
    ConsolidatedCopy consolidated;
    UCP_ASSIGN_OR_RETURN(consolidated.file, doc.U32(copy, copy_path, "file"));
    UCP_ASSIGN_OR_RETURN(consolidated.offset, doc.U64(copy, copy_path, "offset"));
    atom.consolidated = consolidated;
  }
  return atom;
}

Result<ParamGroup> ReadGroup(const DocumentReader& doc, const Json& value,
                             const std::string& path) {
  UCP_RETURN_IF_ERROR(doc.Object(value, path, {"params", "hyperparameters", "scalars"}));
  ParamGroup group;
  UCP_ASSIGN_OR_RETURN(const Json* params, doc.Array(value, path, "params"));
  for (size_t i = 0; i < params->size(); ++i) {
    UCP_ASSIGN_OR_RETURN(std::string param,
                         doc.String((*params)[i], Element(Member(path, "params"), i)));
    group.params.push_back(std::move(param));
  }
  UCP_ASSIGN_OR_RETURN(const Json* hyperparameters, doc.Get(value, path, "hyperparameters"));
  UCP_ASSIGN_OR_RETURN(const Json* scalars, doc.Get(value, path, "scalars"));
  group.hyperparameters = *hyperparameters;
  group.scalars = *scalars;
  return group;
}

Result<CarriedObject> ReadCarried(const DocumentReader& doc, const Json& value,
                                  const std::string& path) {
  UCP_RETURN_IF_ERROR(doc.Object(value, path, {"role", "file", "rewritten"}));
  CarriedObject carried;
  UCP_ASSIGN_OR_RETURN(carried.role, doc.String(value, path, "role"));
  UCP_ASSIGN_OR_RETURN(carried.file, doc.U32(value, path, "file"));
  UCP_ASSIGN_OR_RETURN(const Json* rewritten, doc.Array(value, path, "rewritten"));
  for (size_t i = 0; i < rewritten->size(); ++i) {
    UCP_ASSIGN_OR_RETURN(std::string field,
                         doc.String((*rewritten)[i], Element(Member(path, "rewritten"), i)));
    carried.rewritten.push_back(std::move(field));
  }
  return carried;
}

Result<AtomIndexContents> ReadDocument(const DocumentReader& doc, const Json& root) {
  if (!root.is_object()) return doc.Error("", "not a JSON object");
  // Format and version first: a newer document's other fields may mean something else.
  UCP_ASSIGN_OR_RETURN(const std::string format, doc.String(root, "", "format"));
  if (format != kAtomIndexFormat) {
    return doc.Error("format", "\"" + format + "\" is not an atom index");
  }
  UCP_ASSIGN_OR_RETURN(const uint64_t version, doc.U64(root, "", "version"));
  if (version > kAtomIndexVersion) {
    return Status::Unsupported(doc.Error("version", "version " + std::to_string(version) +
                                                        " is newer than this reader (" +
                                                        std::to_string(kAtomIndexVersion) + ")")
                                   .message());
  }
  if (version == 0) return doc.Error("version", "version 0 does not exist");
  if (version >= 2) {
    UCP_RETURN_IF_ERROR(
        doc.Object(root, "",
                   {"format", "version", "framework", "adapter", "tag", "topology", "files",
                    "atoms", "groups", "carried", "adapter_state", "store"}));
  } else {
    UCP_RETURN_IF_ERROR(doc.Object(root, "",
                                   {"format", "version", "framework", "adapter", "tag", "topology",
                                    "files", "atoms", "groups", "carried", "adapter_state"}));
  }

  AtomIndexContents contents;
  UCP_ASSIGN_OR_RETURN(const Json* framework, doc.Get(root, "", "framework"));
  UCP_RETURN_IF_ERROR(doc.Object(*framework, "framework", {"name", "version"}));
  UCP_ASSIGN_OR_RETURN(contents.framework, doc.String(*framework, "framework", "name"));
  UCP_ASSIGN_OR_RETURN(contents.framework_version, doc.String(*framework, "framework", "version"));

  UCP_ASSIGN_OR_RETURN(const Json* adapter, doc.Get(root, "", "adapter"));
  UCP_RETURN_IF_ERROR(doc.Object(*adapter, "adapter", {"name", "schema"}));
  UCP_ASSIGN_OR_RETURN(contents.adapter, doc.String(*adapter, "adapter", "name"));
  UCP_ASSIGN_OR_RETURN(contents.adapter_schema, doc.U32(*adapter, "adapter", "schema"));

  UCP_ASSIGN_OR_RETURN(contents.tag, doc.String(root, "", "tag"));

  UCP_ASSIGN_OR_RETURN(const Json* topology, doc.Get(root, "", "topology"));
  UCP_RETURN_IF_ERROR(doc.Object(*topology, "topology", {"dp", "tp", "pp", "world", "zero_stage"}));
  UCP_ASSIGN_OR_RETURN(contents.topology.dp, doc.U32(*topology, "topology", "dp"));
  UCP_ASSIGN_OR_RETURN(contents.topology.tp, doc.U32(*topology, "topology", "tp"));
  UCP_ASSIGN_OR_RETURN(contents.topology.pp, doc.U32(*topology, "topology", "pp"));
  UCP_ASSIGN_OR_RETURN(contents.topology.world, doc.U32(*topology, "topology", "world"));
  UCP_ASSIGN_OR_RETURN(contents.topology.zero_stage, doc.U32(*topology, "topology", "zero_stage"));

  UCP_ASSIGN_OR_RETURN(const Json* files, doc.Array(root, "", "files"));
  for (size_t i = 0; i < files->size(); ++i) {
    UCP_ASSIGN_OR_RETURN(IndexedFile file,
                         ReadFileEntry(doc, (*files)[i], Element("files", i), version));
    contents.files.push_back(std::move(file));
  }
  UCP_ASSIGN_OR_RETURN(const Json* atoms, doc.Array(root, "", "atoms"));
  for (size_t i = 0; i < atoms->size(); ++i) {
    UCP_ASSIGN_OR_RETURN(Atom atom, ReadAtom(doc, (*atoms)[i], Element("atoms", i), version));
    contents.atoms.push_back(std::move(atom));
  }
  UCP_ASSIGN_OR_RETURN(const Json* groups, doc.Array(root, "", "groups"));
  for (size_t i = 0; i < groups->size(); ++i) {
    UCP_ASSIGN_OR_RETURN(ParamGroup group, ReadGroup(doc, (*groups)[i], Element("groups", i)));
    contents.groups.push_back(std::move(group));
  }
  UCP_ASSIGN_OR_RETURN(const Json* carried, doc.Array(root, "", "carried"));
  for (size_t i = 0; i < carried->size(); ++i) {
    UCP_ASSIGN_OR_RETURN(CarriedObject object,
                         ReadCarried(doc, (*carried)[i], Element("carried", i)));
    contents.carried.push_back(std::move(object));
  }
  UCP_ASSIGN_OR_RETURN(const Json* adapter_state, doc.Get(root, "", "adapter_state"));
  contents.adapter_state = *adapter_state;
  if (root.contains("store")) {
    const Json& store = root["store"];
    UCP_RETURN_IF_ERROR(doc.Object(store, "store", {"directory", "max_shard_bytes"}));
    AtomsStore atoms_store;
    UCP_ASSIGN_OR_RETURN(atoms_store.directory, doc.String(store, "store", "directory"));
    UCP_ASSIGN_OR_RETURN(atoms_store.max_shard_bytes, doc.U64(store, "store", "max_shard_bytes"));
    contents.store = std::move(atoms_store);
  }
  return contents;
}

// XXH3-64 of the document's canonical text: compact, members in sorted order, the "checksum"
// member left out (the caller removes it first).
uint64_t DocumentXxh3(const Json& root) {
  const std::string text = root.dump(-1, ' ', false, Json::error_handler_t::replace);
  return XXH3_64bits(text.data(), text.size());
}

// A document written by this code carries "checksum" (DocumentXxh3 as 16 hex digits), so that a
// changed byte that still parses and validates (an offset, a shape) is refused rather than
// served; documents from before the member are read without it.
Status CheckAndRemoveChecksum(const DocumentReader& doc, Json& root) {
  if (!root.is_object() || !root.contains("checksum")) return Status::Ok();
  UCP_ASSIGN_OR_RETURN(const std::string recorded, doc.String(root, "", "checksum"));
  root.erase("checksum");
  const std::string computed = HexXxh3(DocumentXxh3(root));
  if (recorded != computed) {
    return doc.Error("checksum", "the document hashes to " + computed + ", not " + recorded +
                                     " (changed after it was written)");
  }
  return Status::Ok();
}

OrderedJson RegionJson(const Region& region) {
  if (region.kind() == Region::Kind::kFlat) {
    return {{"flat", {region.bounds().begin, region.bounds().end}}};
  }
  return {{"box", {{"offsets", region.offsets()}, {"extents", region.extents()}}}};
}

// Free-form members keep their own (sorted) key order; converting through text is the one
// conversion nlohmann offers between its two object orderings.
OrderedJson Ordered(const Json& value) {
  return OrderedJson::parse(value.dump(-1, ' ', false, Json::error_handler_t::replace));
}

// The store rules of the file comment; `error` formats a message at a field path.
template <typename ErrorAt>
Status CheckStore(const AtomIndexContents& c, const ErrorAt& error) {
  if (!c.store) {
    for (size_t i = 0; i < c.files.size(); ++i) {
      if (c.files[i].copy_of) return error(Member(Element("files", i), "copy_of"), "no store");
    }
    for (size_t a = 0; a < c.atoms.size(); ++a) {
      if (c.atoms[a].consolidated) {
        return error(Member(Element("atoms", a), "consolidated"), "no store");
      }
    }
    return Status::Ok();
  }
  const AtomsStore& store = *c.store;
  if (!IsNormalRelativePath(store.directory)) {
    return error("store.directory",
                 "\"" + store.directory + "\" is not a normalised path inside the tag");
  }
  if (store.max_shard_bytes == 0) return error("store.max_shard_bytes", "0");
  const std::string prefix = store.directory + "/";
  std::vector<uint32_t> copies(c.files.size(), 0);
  for (size_t i = 0; i < c.files.size(); ++i) {
    const IndexedFile& file = c.files[i];
    const std::string path = Element("files", i);
    const bool in_store = file.path.starts_with(prefix);
    if (AtomIndex::IsStoreFile(file) != in_store) {
      return error(Member(path, "path"), "\"" + file.path + "\" with role \"" + file.role +
                                             "\": store files, and only they, lie in " +
                                             store.directory);
    }
    if ((file.role == kStoreCopyRole) != file.copy_of.has_value()) {
      return error(Member(path, "copy_of"),
                   "exactly the files with role " + std::string(kStoreCopyRole) + " have one");
    }
    if (!file.copy_of) continue;
    const uint32_t original = *file.copy_of;
    if (original >= c.files.size() || AtomIndex::IsStoreFile(c.files[original])) {
      return error(Member(path, "copy_of"),
                   std::to_string(original) + " is not a framework file of the index");
    }
    if (c.files[original].size != file.size || c.files[original].xxh3 != file.xxh3) {
      return error(Member(path, "copy_of"),
                   "size or xxh3 differs from " + c.files[original].path + "'s");
    }
    ++copies[original];
  }
  for (size_t i = 0; i < c.carried.size(); ++i) {
    if (copies[c.carried[i].file] != 1) {
      return error(Member(Element("carried", i), "file"),
                   c.files[c.carried[i].file].path + " has " +
                       std::to_string(copies[c.carried[i].file]) + " copies in the store, not 1");
    }
  }
  for (size_t a = 0; a < c.atoms.size(); ++a) {
    const Atom& atom = c.atoms[a];
    const std::string path = Member(Element("atoms", a), "consolidated");
    if (!atom.consolidated) return error(path, "missing (the index has a store)");
    if (atom.consolidated->file >= c.files.size() ||
        c.files[atom.consolidated->file].role != kStoreAtomsRole) {
      return error(Member(path, "file"), std::to_string(atom.consolidated->file) +
                                             " is not a file with role " +
                                             std::string(kStoreAtomsRole));
    }
    const IndexedFile& file = c.files[atom.consolidated->file];
    const Result<uint64_t> numel = NumElements(atom.shape);
    const std::optional<uint64_t> bytes =
        numel.ok() ? CheckedMul(*numel, ItemSize(atom.dtype)) : std::nullopt;
    if (!bytes || !RangeWithin(atom.consolidated->offset, *bytes, file.size)) {
      return error(Member(path, "offset"), "beyond the end of file " + file.path + " (size " +
                                               std::to_string(file.size) + ")");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<AtomIndex> AtomIndex::Create(AtomIndexContents contents, std::string source) {
  const auto error = [&](const std::string& path, const std::string& what) {
    return Status::InvalidArgument("atom index " + source + ": " + path + ": " + what);
  };
  if (contents.framework.empty()) return error("framework.name", "empty");
  if (contents.adapter.empty()) return error("adapter.name", "empty");
  if (contents.tag.empty() || !IsNormalRelativePath(contents.tag) ||
      contents.tag.find('/') != std::string::npos) {
    return error("tag", "\"" + contents.tag + "\" is not a directory name");
  }
  const Topology& topology = contents.topology;
  if (topology.dp == 0 || topology.tp == 0 || topology.pp == 0) {
    return error("topology", "dp, tp and pp must be at least 1");
  }
  const std::optional<uint32_t> dp_tp = CheckedMul(topology.dp, topology.tp);
  const std::optional<uint32_t> world = dp_tp ? CheckedMul(*dp_tp, topology.pp) : std::nullopt;
  if (!world || *world != topology.world) {
    return error("topology.world", std::to_string(topology.world) + " is not dp × tp × pp");
  }
  if (topology.zero_stage > 3) {
    return error("topology.zero_stage", std::to_string(topology.zero_stage) + " is not 0..3");
  }

  AtomIndex index(std::move(contents));
  const AtomIndexContents& c = index.contents_;
  for (size_t i = 0; i < c.files.size(); ++i) {
    const IndexedFile& file = c.files[i];
    const std::string path = Element("files", i);
    if (!IsNormalRelativePath(file.path)) {
      return error(Member(path, "path"),
                   "\"" + file.path + "\" is not a normalised path inside the tag");
    }
    if (!index.file_by_path_.emplace(file.path, i).second) {
      return error(Member(path, "path"), "\"" + file.path + "\" is listed twice");
    }
    if (file.role.empty()) return error(Member(path, "role"), "empty");
    if (const std::string wrong = ChunkHashesMismatch(file.chunks, file.size); !wrong.empty()) {
      return error(Member(path, "chunks"), wrong);
    }
    if (file.rank && (file.rank->dp >= topology.dp || file.rank->tp >= topology.tp ||
                      file.rank->pp >= topology.pp)) {
      return error(Member(path, "rank"), "outside the topology");
    }
  }
  std::set<std::string, std::less<>> params;
  for (size_t a = 0; a < c.atoms.size(); ++a) {
    const Atom& atom = c.atoms[a];
    const std::string path = Element("atoms", a);
    if (atom.param.empty()) return error(Member(path, "param"), "empty");
    if (atom.state.empty()) return error(Member(path, "state"), "empty");
    if (!index.atom_by_name_.emplace(std::make_pair(atom.param, atom.state), a).second) {
      return error(path, "atom (" + atom.param + ", " + atom.state + ") is listed twice");
    }
    params.insert(atom.param);
    if (const Result<uint64_t> numel = NumElements(atom.shape); !numel.ok()) {
      return error(Member(path, "shape"), numel.status().message());
    }
    std::vector<Region> regions;
    regions.reserve(atom.fragments.size());
    for (size_t f = 0; f < atom.fragments.size(); ++f) {
      const Fragment& fragment = atom.fragments[f];
      const std::string fragment_path = Element(Member(path, "fragments"), f);
      if (fragment.file >= c.files.size()) {
        return error(Member(fragment_path, "file"), "file " + std::to_string(fragment.file) +
                                                        " does not exist (" +
                                                        std::to_string(c.files.size()) + " files)");
      }
      if (fragment.dtype != atom.dtype) {
        return error(Member(fragment_path, "dtype"), std::string(TorchName(fragment.dtype)) +
                                                         " differs from the atom's " +
                                                         std::string(TorchName(atom.dtype)));
      }
      if (fragment.region.shape() != atom.shape) {
        return error(Member(fragment_path, "region"),
                     fragment.region.ToString() + " is of another shape than the atom");
      }
      const IndexedFile& file = c.files[fragment.file];
      const std::optional<uint64_t> bytes =
          CheckedMul(fragment.region.numel(), ItemSize(fragment.dtype));
      if (!bytes || !RangeWithin(fragment.offset, *bytes, file.size)) {
        return error(
            Member(fragment_path, "offset"),
            "beyond the end of file " + file.path + " (size " + std::to_string(file.size) + ")");
      }
      regions.push_back(fragment.region);
    }
    if (Status tiling = CheckTiling(regions, atom.shape); !tiling.ok()) {
      return error(Member(path, "fragments"),
                   "the regions (by fragment index) do not tile the atom: " + tiling.message());
    }
  }
  std::set<std::string, std::less<>> grouped;
  for (size_t g = 0; g < c.groups.size(); ++g) {
    const ParamGroup& group = c.groups[g];
    const std::string path = Element("groups", g);
    for (size_t p = 0; p < group.params.size(); ++p) {
      const std::string param_path = Element(Member(path, "params"), p);
      if (params.count(group.params[p]) == 0) {
        return error(param_path, "\"" + group.params[p] + "\" is the param of no atom");
      }
      if (!grouped.insert(group.params[p]).second) {
        return error(param_path, "\"" + group.params[p] + "\" is in more than one group");
      }
    }
    if (!group.hyperparameters.is_object()) {
      return error(Member(path, "hyperparameters"), "not an object");
    }
    if (!group.scalars.is_object()) return error(Member(path, "scalars"), "not an object");
  }
  for (size_t i = 0; i < c.carried.size(); ++i) {
    const std::string path = Element("carried", i);
    if (c.carried[i].role.empty()) return error(Member(path, "role"), "empty");
    if (c.carried[i].file >= c.files.size()) {
      return error(Member(path, "file"), "file " + std::to_string(c.carried[i].file) +
                                             " does not exist (" + std::to_string(c.files.size()) +
                                             " files)");
    }
  }
  if (!c.adapter_state.is_object()) return error("adapter_state", "not an object");
  UCP_RETURN_IF_ERROR(CheckStore(c, error));
  return index;
}

Result<AtomIndex> AtomIndex::Parse(std::string_view json, std::string source) {
  Json root = Json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return Status::Corrupt("atom index " + source + ": not a valid JSON document");
  }
  const DocumentReader doc(source);
  UCP_RETURN_IF_ERROR(CheckAndRemoveChecksum(doc, root));
  UCP_ASSIGN_OR_RETURN(AtomIndexContents contents, ReadDocument(doc, root));
  Result<AtomIndex> index = Create(std::move(contents), source);
  // What is invalid in memory is a corrupt document on disk.
  if (!index.ok() && index.status().code() == StatusCode::kInvalidArgument) {
    return Status::Corrupt(index.status().message());
  }
  return index;
}

Result<AtomIndex> AtomIndex::Read(const std::string& path) {
  Result<std::string> text = ReadSmallFile(path, kMaxAtomIndexBytes);
  if (!text.ok()) return text.status().WithContext("atom index");
  return Parse(*text, path);
}

const Atom* AtomIndex::Find(std::string_view param, std::string_view state) const {
  const auto it = atom_by_name_.find(std::make_pair(std::string(param), std::string(state)));
  return it == atom_by_name_.end() ? nullptr : &contents_.atoms[it->second];
}

const IndexedFile* AtomIndex::FindFile(std::string_view path) const {
  const auto it = file_by_path_.find(path);
  return it == file_by_path_.end() ? nullptr : &contents_.files[it->second];
}

bool AtomIndex::IsStoreFile(const IndexedFile& file) {
  return file.role == kStoreAtomsRole || file.role == kStoreCopyRole;
}

Result<AtomIndex> AtomIndex::OverStore() const {
  if (!contents_.store) {
    return Status::FailedPrecondition("atom index of " + contents_.tag + ": no atoms store");
  }
  AtomIndexContents over = contents_;
  over.store.reset();
  // Copies replace their originals in place; the consolidated files follow the framework files.
  std::vector<uint32_t> new_file(contents_.files.size(), 0);
  over.files.clear();
  for (size_t i = 0; i < contents_.files.size(); ++i) {
    if (!IsStoreFile(contents_.files[i])) {
      new_file[i] = static_cast<uint32_t>(over.files.size());
      over.files.push_back(contents_.files[i]);
    }
  }
  for (size_t i = 0; i < contents_.files.size(); ++i) {
    const IndexedFile& file = contents_.files[i];
    if (file.role == kStoreAtomsRole) {
      new_file[i] = static_cast<uint32_t>(over.files.size());
      over.files.push_back(file);
    } else if (file.copy_of) {
      IndexedFile& original = over.files[new_file[*file.copy_of]];
      original.path = file.path;
      original.size = file.size;
      original.xxh3 = file.xxh3;
      original.chunks = file.chunks;
    }
  }
  for (CarriedObject& carried : over.carried) carried.file = new_file[carried.file];
  for (Atom& atom : over.atoms) {
    UCP_ASSIGN_OR_RETURN(Region whole, Region::Whole(atom.shape));
    atom.fragments = {Fragment{new_file[atom.consolidated->file], atom.consolidated->offset,
                               atom.dtype, std::move(whole)}};
    atom.consolidated.reset();
  }
  return Create(std::move(over), "of " + contents_.tag + " over its atoms store");
}

std::string AtomIndex::ToJson() const {
  const AtomIndexContents& c = contents_;
  OrderedJson root = OrderedJson::object();
  root["format"] = kAtomIndexFormat;
  const bool chunked = std::any_of(c.files.begin(), c.files.end(),
                                   [](const IndexedFile& file) { return file.chunks.recorded(); });
  root["version"] = chunked ? 3 : c.store ? 2 : 1;
  root["framework"] = {{"name", c.framework}, {"version", c.framework_version}};
  root["adapter"] = {{"name", c.adapter}, {"schema", c.adapter_schema}};
  root["tag"] = c.tag;
  root["topology"] = {{"dp", c.topology.dp},
                      {"tp", c.topology.tp},
                      {"pp", c.topology.pp},
                      {"world", c.topology.world},
                      {"zero_stage", c.topology.zero_stage}};
  OrderedJson files = OrderedJson::array();
  for (const IndexedFile& file : c.files) {
    OrderedJson entry = {{"path", file.path},
                         {"size", file.size},
                         {"xxh3", HexXxh3(file.xxh3)},
                         {"role", file.role}};
    if (file.rank) {
      entry["rank"] = {{"dp", file.rank->dp}, {"tp", file.rank->tp}, {"pp", file.rank->pp}};
    }
    if (file.copy_of) entry["copy_of"] = *file.copy_of;
    PutChunkHashes(file.chunks, entry);
    files.push_back(std::move(entry));
  }
  root["files"] = std::move(files);
  OrderedJson atoms = OrderedJson::array();
  for (const Atom& atom : c.atoms) {
    OrderedJson fragments = OrderedJson::array();
    for (const Fragment& fragment : atom.fragments) {
      fragments.push_back({{"file", fragment.file},
                           {"offset", fragment.offset},
                           {"dtype", TorchName(fragment.dtype)},
                           {"region", RegionJson(fragment.region)}});
    }
    OrderedJson entry = {{"param", atom.param},
                         {"state", atom.state},
                         {"dtype", TorchName(atom.dtype)},
                         {"shape", atom.shape},
                         {"fragments", std::move(fragments)}};
    if (atom.consolidated) {
      entry["consolidated"] = {{"file", atom.consolidated->file},
                               {"offset", atom.consolidated->offset}};
    }
    atoms.push_back(std::move(entry));
  }
  root["atoms"] = std::move(atoms);
  OrderedJson groups = OrderedJson::array();
  for (const ParamGroup& group : c.groups) {
    groups.push_back({{"params", group.params},
                      {"hyperparameters", Ordered(group.hyperparameters)},
                      {"scalars", Ordered(group.scalars)}});
  }
  root["groups"] = std::move(groups);
  OrderedJson carried = OrderedJson::array();
  for (const CarriedObject& object : c.carried) {
    carried.push_back(
        {{"role", object.role}, {"file", object.file}, {"rewritten", object.rewritten}});
  }
  root["carried"] = std::move(carried);
  root["adapter_state"] = Ordered(c.adapter_state);
  if (c.store) {
    root["store"] = {{"directory", c.store->directory},
                     {"max_shard_bytes", c.store->max_shard_bytes}};
  }
  root["checksum"] = HexXxh3(
      DocumentXxh3(Json::parse(root.dump(-1, ' ', false, OrderedJson::error_handler_t::replace))));
  return root.dump(1, ' ', false, OrderedJson::error_handler_t::replace) + "\n";
}

Status AtomIndex::Write(const std::string& path) const {
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  std::error_code error;
  const bool create = !dir.empty() && !std::filesystem::is_directory(dir, error);
  if (create) {
    UCP_RETURN_IF_ERROR(CreateDirectories(dir.string()).WithContext("atom index " + path));
  }
  UCP_RETURN_IF_ERROR(WriteFileAtomically(path, ToJson()).WithContext("atom index " + path));
  // A directory made here (the tag's .ucp/) must itself be durable in its parent.
  if (create) {
    const std::string parent = dir.parent_path().string();
    return SyncDirectory(parent.empty() ? "." : parent).WithContext("atom index " + path);
  }
  return Status::Ok();
}

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

}  // namespace ucp
