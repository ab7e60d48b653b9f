#include "hooks/serve/view_cache.h"

#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "core/io/file.h"
#include "core/io/file_lock.h"
#include "core/tag/journal.h"
#include "core/tag/source_check.h"
#include "core/util/log.h"

namespace ucp::hooks {
namespace {

// 2: the view's creator makes every placeholder (1: each process made those it described).
constexpr int kViewVersion = 2;
// <view>/verdict's contents: "complete", or "failed: " and the first failure.
constexpr std::string_view kComplete = "complete\n";
constexpr std::string_view kFailed = "failed: ";
constexpr uint64_t kMaxViewJsonBytes = uint64_t{1} << 20;
// A part's mark: a line of about 40 bytes per storage piece it wrote (400 000 pieces at most).
constexpr uint64_t kMaxMarkBytes = uint64_t{16} << 20;

std::string LastComponent(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool IsRegularFile(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

// The file name without its last extension: what torch.save calls the archive inside it.
std::string Stem(const std::string& name) {
  std::string last = LastComponent(name);
  const size_t dot = last.rfind('.');
  return dot == std::string::npos ? last : last.substr(0, dot);
}

// One output of `plan` per name (the path the framework asks for), moved out of it and retargeted
// at its stored name. An archive keeps the record prefix its own name gives it, so its bytes are
// those `ucp reshard` writes under that name.
std::map<std::string, OutputPlan> SplitPlan(OutputPlan plan) {
  std::map<std::string, OutputPlan> plans;
  for (ArchiveOutput& output : plan.archives) {
    std::string name = std::exchange(output.path, StoredName(output.path));
    if (output.archive_name.empty()) output.archive_name = Stem(name);
    plans[name].archives.push_back(std::move(output));
  }
  for (SafetensorsOutput& output : plan.safetensors) {
    std::string name = std::exchange(output.path, StoredName(output.path));
    plans[name].safetensors.push_back(std::move(output));
  }
  for (CopyOutput& output : plan.copies) {
    std::string name = std::exchange(output.path, StoredName(output.path));
    plans[name].copies.push_back(output);
  }
  for (TextOutput& output : plan.texts) {
    std::string name = std::exchange(output.path, StoredName(output.path));
    plans[name].texts.push_back(std::move(output));
  }
  return plans;
}

nlohmann::json TargetJson(const Topology& target) {
  return {{"dp", target.dp}, {"tp", target.tp}, {"pp", target.pp}, {"world", target.world}};
}

// view.json's verdict for the index, or nullopt when it is absent, unreadable or about another
// index or target (the view is then re-created).
struct Recorded {
  bool verified = false;
  std::string error;
};

std::optional<Recorded> ReadViewJson(const std::string& path, const std::string& index_hex,
                                     const Topology& target) {
  Result<File> file = File::Open(path, File::Mode::kRead);
  if (!file.ok()) return std::nullopt;
  Result<uint64_t> size = file->Size();
  if (!size.ok() || *size > kMaxViewJsonBytes) return std::nullopt;
  std::string bytes(*size, '\0');
  if (!file->ReadAt(0, {reinterpret_cast<std::byte*>(bytes.data()), bytes.size()}).ok()) {
    return std::nullopt;
  }
  const nlohmann::json json = nlohmann::json::parse(bytes, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) return std::nullopt;
  const auto field = [&](const char* key) { return json.find(key); };
  if (field("version") == json.end() || *field("version") != kViewVersion ||
      field("index_xxh3") == json.end() || *field("index_xxh3") != index_hex ||
      field("target") == json.end() || *field("target") != TargetJson(target) ||
      field("verified") == json.end() || !field("verified")->is_boolean()) {
    return std::nullopt;
  }
  Recorded recorded;
  recorded.verified = field("verified")->get<bool>();
  if (const auto error = field("error"); error != json.end() && error->is_string()) {
    recorded.error = error->get<std::string>();
  }
  return recorded;
}

// Removes everything in `directory` but the lock files: the files of a view of another index.
// Build locks stay, so that a process still building under one keeps excluding the others.
Status EmptyView(const std::string& directory) {
  std::error_code error;
  std::vector<std::filesystem::path> doomed;
  for (std::filesystem::directory_iterator it(directory, error), end; !error && it != end;
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    // Locks, and leases a live builder may hold, stay (a dead one's is taken over).
    if (name.starts_with('.') && (name.ends_with(".lock") || name.ends_with(".lease"))) continue;
    doomed.push_back(it->path());
  }
  if (error) return PosixError("view: list " + directory, error.value());
  for (const std::filesystem::path& path : doomed) {
    std::filesystem::remove_all(path, error);
    if (error) return PosixError("view: remove " + path.string(), error.value());
  }
  return Status::Ok();
}

// Fills each directory's set with the names of the regular files in it (none where the
// directory does not exist): one listing per directory, no stat where the file system gives
// the type in the listing (d_type).
Status ListRegularFiles(std::map<std::string, std::set<std::string>>& entries) {
  for (auto& [directory, found] : entries) {
    std::error_code error;
    for (std::filesystem::directory_iterator it(directory, error), end; !error && it != end;
         it.increment(error)) {
      std::error_code type_error;
      if (it->is_regular_file(type_error)) found.insert(it->path().filename().string());
    }
    if (error && error != std::errc::no_such_file_or_directory) {
      return PosixError("view: list " + directory, error.value());
    }
  }
  return Status::Ok();
}

// Makes, in an emptied view, for each name whose size the plan tells, a sparse file of that size
// at <directory>/.planned/<stored name>: what a stat of the name reports until the process may
// serve the built file.
Status MakePlaceholders(const std::map<std::string, OutputPlan>& plans, const AtomIndex& index,
                        const std::string& directory) {
  for (const auto& [name, plan] : plans) {
    UCP_ASSIGN_OR_RETURN(const std::optional<uint64_t> size, PlannedFileSize(plan, index));
    if (!size) continue;
    const std::string placeholder = directory + "/.planned/" + StoredName(name);
    const std::filesystem::path path(placeholder);
    std::error_code error;
    std::filesystem::create_directories(path.parent_path(), error);
    if (error) return PosixError("view: placeholder directory for " + placeholder, error.value());
    // Written whole under a name of this process's, then renamed: where flock is per node, a
    // creator on another node sees no placeholder or a complete one.
    static std::atomic<uint64_t> counter{0};
    const std::string temp = placeholder + ".tmp-" + std::to_string(::getpid()) + "-" +
                             std::to_string(counter.fetch_add(1));
    UCP_ASSIGN_OR_RETURN(File file, File::Open(temp, File::Mode::kCreateExclusive));
    Status status = file.Truncate(*size);
    if (status.ok()) status = file.Close();
    if (status.ok()) status = RenameFile(temp, placeholder);
    if (!status.ok()) {
      (void)file.Close();  // already failing: the first error is the one reported
      (void)RemoveFile(temp);
      return status.WithContext("view: placeholder " + placeholder);
    }
  }
  return Status::Ok();
}

// Under the view's .lock: reuses view.json's verdict for this index, or empties the view,
// verifies the sources, makes the placeholders and records the verdict. Returns `plan` split per
// name (SplitPlan).
Result<std::map<std::string, OutputPlan>> CheckOrCreateView(const AtomIndex& index, OutputPlan plan,
                                                            uint64_t index_xxh3,
                                                            const std::string& tag_dir,
                                                            const std::string& directory,
                                                            const Topology& target) {
  const std::string index_hex = FormatXxh3(index_xxh3);
  const std::string json_path = directory + "/view.json";
  if (const std::optional<Recorded> recorded = ReadViewJson(json_path, index_hex, target)) {
    if (recorded->verified) return SplitPlan(std::move(plan));
    return Status::Corrupt(recorded->error + " (recorded in " + json_path + ")");
  }
  UCP_RETURN_IF_ERROR(EmptyView(directory));
  const Status verified = CheckSourcesBeforeReading(index, plan, tag_dir, "view");
  // Only a verdict on the bytes is recorded: a read that failed (EIO, a file missing for now)
  // says nothing about them, and recording it would refuse the view to every later process.
  if (!verified.ok() && verified.code() != StatusCode::kCorrupt) return verified;
  std::map<std::string, OutputPlan> plans = SplitPlan(std::move(plan));
  // Once per view, by its creator: every process's stats then find them.
  if (verified.ok()) UCP_RETURN_IF_ERROR(MakePlaceholders(plans, index, directory));
  nlohmann::json json = {{"version", kViewVersion},
                         {"index_xxh3", index_hex},
                         {"target", TargetJson(target)},
                         {"verified", verified.ok()},
                         {"error", verified.ok() ? "" : verified.message()}};
  UCP_RETURN_IF_ERROR(WriteFileAtomically(json_path, json.dump(2) + "\n"));
  UCP_LOG_INFO("view: created {} for index {} ({})", directory, index_hex,
               verified.ok() ? "sources verified" : verified.message());
  if (!verified.ok()) return verified;
  return plans;
}

// `name` as one component, for the files about it beside the view's top-level files: names may
// have directories.
std::string Flattened(const std::string& name) {
  std::string flat = name;
  for (char& c : flat) c = c == '/' ? '#' : c;
  return flat;
}

// The file name of `name`'s lease.
std::string LeaseFileName(const std::string& name) { return "." + Flattened(name) + ".lease"; }

// The file names of part `k` of `count` of `name`'s lease and of its written mark. '#' comes
// from no other name: a file `x` and a file `x/part0of2` cannot both exist. The count names the
// cuts (PlanArchiveParts cuts an archive by the count alone), so the marks of a build divided
// otherwise (another UCP_BUILD_PART_KB) are never taken for this one's.
std::string PartFileName(const std::string& name, size_t k, size_t count, std::string_view suffix) {
  return "." + Flattened(name) + "#part" + std::to_string(k) + "of" + std::to_string(count) +
         std::string(suffix);
}

}  // namespace

std::string StoredName(std::string_view name) {
  const size_t slash = name.rfind('/');
  const size_t start = slash == std::string_view::npos ? 0 : slash + 1;
  return std::string(name.substr(0, start)) + std::string(kStoredPrefix) +
         std::string(name.substr(start));
}

std::string ViewName(const Topology& topology) {
  // ep and the partition only when given, so that the views of other tags keep their names.
  return "tp" + std::to_string(topology.tp) + "-pp" + std::to_string(topology.pp) + "-dp" +
         std::to_string(topology.dp) +
         (topology.ep != 0 ? "-ep" + std::to_string(topology.ep) : std::string()) +
         (topology.partition != LayerPartition::kInferred
              ? "-" + std::string(LayerPartitionName(topology.partition))
              : std::string());
}

std::string ViewDirectory(const std::string& tag_dir, const std::string& cache_dir,
                          const Topology& target) {
  if (cache_dir.empty()) return tag_dir + "/.ucp/views/" + ViewName(target);
  const uint64_t tag_hash = XXH3_64bits(tag_dir.data(), tag_dir.size());
  return cache_dir + "/" + LastComponent(tag_dir) + "-" + FormatXxh3(tag_hash) + "/" +
         ViewName(target);
}

std::vector<size_t> BuildOrder(size_t count, const std::optional<JobPlace>& place) {
  size_t start = 0;
  if (count > 0 && place && place->world > 0) {
    start = static_cast<size_t>(uint64_t{place->rank % place->world} * count / place->world);
  } else if (count > 0) {
    const std::string self = JournalHostName() + " " + std::to_string(::getpid());
    start = static_cast<size_t>(XXH3_64bits(self.data(), self.size()) % count);
  }
  std::vector<size_t> order(count);
  for (size_t i = 0; i < count; ++i) order[i] = (start + i) % count;
  return order;
}

Result<std::unique_ptr<View>> View::Open(const FrameworkAdapter& adapter,
                                         std::shared_ptr<const AtomIndex> index,
                                         uint64_t index_xxh3, std::string tag_dir,
                                         const std::string& cache_dir, const Topology& target,
                                         const OwnerLease::Options& lease,
                                         std::optional<JobPlace> place, uint64_t part_bytes) {
  if (index == nullptr) return Status::InvalidArgument("view: no index for " + tag_dir);
  UCP_ASSIGN_OR_RETURN(OutputPlan plan, adapter.PlanReshard(*index, tag_dir, target));
  std::string directory = ViewDirectory(tag_dir, cache_dir, target);
  UCP_RETURN_IF_ERROR(CreateDirectories(directory));
  std::map<std::string, OutputPlan> plans;
  {
    UCP_ASSIGN_OR_RETURN(FileLock lock, FileLock::Acquire(directory + "/.lock"));
    UCP_ASSIGN_OR_RETURN(
        plans, CheckOrCreateView(*index, std::move(plan), index_xxh3, tag_dir, directory, target));
  }
  std::unique_ptr<View> view(new View(std::move(index), std::move(tag_dir), std::move(directory),
                                      std::move(plans), lease, cache_dir.empty(), place,
                                      part_bytes));
  UCP_RETURN_IF_ERROR(view->CheckNoBuildFailed());
  return view;
}

std::string View::VerdictPath() const { return directory_ + "/verdict"; }

std::optional<Status> View::ReadVerdict() const {
  // The recorded error is one status line; the limit bounds what a damaged file could make us read.
  Result<std::string> recorded = ReadSmallFile(VerdictPath(), 64 << 10);
  if (!recorded.ok()) {
    if (recorded.status().code() == StatusCode::kNotFound) return std::nullopt;
    return recorded.status().WithContext("view: verdict");
  }
  if (*recorded == kComplete) return Status::Ok();
  const std::string error =
      recorded->starts_with(kFailed) ? recorded->substr(kFailed.size()) : *recorded;
  return Status::FailedPrecondition(
      "view " + directory_ + ": a process of the job failed to build a file of it: " + error +
      " (recorded in " + VerdictPath() + ")");
}

Status View::CheckNoBuildFailed() const {
  const std::optional<Status> verdict = ReadVerdict();
  return verdict ? *verdict : Status::Ok();
}

Status View::RecordVerdict(const Status& outcome) const {
  // Written whole under a name of this process's, then linked to the verdict's name: link(2)
  // creates it only where it does not exist, decided once by the file system for all nodes, so
  // the first verdict stands and every process reads the same one.
  static std::atomic<uint64_t> counter{0};
  const std::string temp = VerdictPath() + ".tmp-" + std::to_string(::getpid()) + "-" +
                           std::to_string(counter.fetch_add(1));
  const std::string text =
      outcome.ok() ? std::string(kComplete) : std::string(kFailed) + outcome.ToString();
  Status written = WriteFileAtomically(temp, text, false);
  if (written.ok() && ::link(temp.c_str(), VerdictPath().c_str()) != 0 && errno != EEXIST) {
    written = PosixError("view: link " + temp + " to " + VerdictPath(), errno);
  }
  (void)RemoveFile(temp);
  if (!written.ok()) return written;
  const std::optional<Status> verdict = ReadVerdict();
  return verdict ? *verdict : Status::Internal("view: " + VerdictPath() + " vanished");
}

View::View(std::shared_ptr<const AtomIndex> index, std::string tag_dir, std::string directory,
           std::map<std::string, OutputPlan> plans, const OwnerLease::Options& lease,
           bool whole_job, std::optional<JobPlace> place, uint64_t part_bytes)
    : index_(std::move(index)),
      tag_dir_(std::move(tag_dir)),
      directory_(std::move(directory)),
      plans_(std::move(plans)),
      lease_options_(lease),
      whole_job_(whole_job),
      place_(place) {
  for (const auto& [name, plan] : plans_) {
    names_.insert(name);
    const std::filesystem::path stored(directory_ + "/" + StoredName(name));
    ListedAs& listed = listed_as_[name];
    listed = {
        stored.parent_path().string(), stored.filename().string(), LeaseFileName(name), {}, {}};
    if (part_bytes == 0 || plan.archives.size() != 1 || !plan.safetensors.empty() ||
        !plan.copies.empty() || !plan.texts.empty()) {
      continue;
    }
    Result<std::vector<ArchivePart>> parts = PlanArchiveParts(plan.archives.front(), part_bytes);
    if (!parts.ok() || parts->size() < 2) continue;
    for (size_t k = 0; k < parts->size(); ++k) {
      listed.part_leases.push_back(PartFileName(name, k, parts->size(), ".lease"));
      listed.part_marks.push_back(PartFileName(name, k, parts->size(), ".done"));
    }
    splits_[name] = {std::move(parts).value(), listed.directory + "/." + listed.stored + ".parts"};
  }
}

Result<const OutputPlan*> View::PlanOf(const std::string& name) const {
  const auto plan = plans_.find(name);
  if (plan == plans_.end()) {
    return Status::NotFound("view " + directory_ + ": no file " + name + " at this topology");
  }
  return &plan->second;
}

Result<std::string> View::Materialize(const std::string& name) {
  UCP_RETURN_IF_ERROR(PlanOf(name).status());
  std::string path = directory_ + "/" + StoredName(name);
  {
    std::lock_guard lock(mutex_);
    if (ready_.contains(name)) return path;
  }
  if (whole_job_) {
    UCP_RETURN_IF_ERROR(AwaitVerdict());
    std::lock_guard lock(mutex_);
    ready_ = names_;
    return path;
  }
  Result<bool> built = Build(name, /*wait=*/true);
  if (!built.ok()) return RecordVerdict(built.status());
  std::lock_guard lock(mutex_);
  ready_.insert(name);
  return path;
}

Status View::AwaitVerdict() {
  if (std::optional<Status> verdict = ReadVerdict()) return *verdict;
  const std::vector<std::string> names(names_.begin(), names_.end());
  const std::vector<size_t> order = BuildOrder(names.size(), place_);
  // The first name in this process's order that `wanted` accepts, given a fresh listing.
  const auto next = [&](Status& failure, const auto& wanted) -> const std::string* {
    Result<Listing> listing = List();
    if (!listing.ok()) failure = listing.status();
    if (!failure.ok()) return nullptr;
    for (const size_t i : order) {
      if (wanted(names[i], *listing)) return &names[i];
    }
    return nullptr;
  };
  // First the files no other process has claimed, so that the job's processes spread over them;
  // each name is tried once, so this ends. Then the rest, waiting for their builders or taking
  // over dead or hung ones.
  Status failure = Status::Ok();
  std::set<std::string> tried;
  while (const std::string* name = next(failure, [&](const std::string& n, const Listing& seen) {
           return !seen.built.contains(n) && !seen.claimed.contains(n) && !tried.contains(n);
         })) {
    tried.insert(*name);
    failure = Build(*name, /*wait=*/false).status();
  }
  std::set<std::string> awaited;
  while (const std::string* name = next(failure, [&](const std::string& n, const Listing& seen) {
           return !seen.built.contains(n) && !awaited.contains(n);
         })) {
    awaited.insert(*name);
    failure = Build(*name, /*wait=*/true).status();
  }
  const Status verdict = RecordVerdict(failure);
  if (!failure.ok() && verdict.ok()) {
    UCP_LOG_INFO("view: {}; another process built the view: {}", failure.message(), directory_);
  }
  return verdict;
}

std::string View::LeasePath(const std::string& name) const {
  return directory_ + "/" + LeaseFileName(name);
}

Result<View::Listing> View::List() const {
  // One listing of each directory the view's names are in (most views have one): what it costs
  // does not grow with the number of processes asking.
  std::map<std::string, std::set<std::string>> entries;  // directory → its regular files
  for (const auto& [name, where] : listed_as_) entries[where.directory];
  entries[directory_];
  UCP_RETURN_IF_ERROR(ListRegularFiles(entries));
  Listing listing;
  const std::set<std::string>& top = entries[directory_];
  for (const auto& [name, where] : listed_as_) {
    if (entries[where.directory].contains(where.stored)) listing.built.insert(name);
    // A file built in parts is claimed once its finisher is at work, or each of its parts is
    // written or being written.
    bool parts_claimed = !where.part_leases.empty();
    for (size_t k = 0; k < where.part_leases.size(); ++k) {
      parts_claimed = parts_claimed &&
                      (top.contains(where.part_leases[k]) || top.contains(where.part_marks[k]));
    }
    if (top.contains(where.lease) || parts_claimed) listing.claimed.insert(name);
  }
  return listing;
}

Result<std::optional<OwnerLease>> View::Claim(const std::string& lease_path, bool wait,
                                              const std::function<bool()>& done) const {
  OwnerLease::Options lease_options = lease_options_;
  if (!wait) lease_options.wait = std::chrono::milliseconds(0);
  // Acquire stops waiting once the build is over or a verdict is there.
  UCP_ASSIGN_OR_RETURN(std::optional<OwnerLease> lease,
                       OwnerLease::Acquire(lease_path, lease_options, [this, &done] {
                         return done() || IsRegularFile(VerdictPath());
                       }));
  UCP_RETURN_IF_ERROR(CheckNoBuildFailed());
  // Without the lease another owner finished; with it, a previous owner may have.
  if (!lease || done()) return std::optional<OwnerLease>();
  return lease;
}

ExecuteOptions View::BuildOptions() const {
  ExecuteOptions options;
  options.threads = 1;
  options.locate_damage = LocateDamageWith(*index_, tag_dir_);
  return options;
}

Result<bool> View::Build(const std::string& name, bool wait) {
  const std::string path = directory_ + "/" + StoredName(name);
  if (IsRegularFile(path)) return true;
  if (splits_.contains(name)) return BuildInParts(name, wait);
  Result<std::optional<OwnerLease>> lease =
      Claim(LeasePath(name), wait, [&path] { return IsRegularFile(path); });
  if (!wait && !lease.ok() && lease.status().code() == StatusCode::kFailedPrecondition) {
    return false;  // another process builds it
  }
  UCP_RETURN_IF_ERROR(lease.status());
  if (!*lease) return true;
  UCP_RETURN_IF_ERROR(ExecutePlan(plans_.at(name), *index_, tag_dir_, directory_, BuildOptions())
                          .WithContext("view: build " + path));
  UCP_LOG_INFO("view: built {}", path);
  std::lock_guard guard(mutex_);
  ++built_;
  return true;
}

Result<bool> View::BuildInParts(const std::string& name, bool wait) {
  Result<bool> built = BuildOrCompleteParts(name, wait);
  // A failed build fails the job's view: no process completes the parts' file, so it goes.
  if (!built.ok()) (void)RemoveFile(splits_.at(name).parts_path);
  return built;
}

Result<bool> View::BuildOrCompleteParts(const std::string& name, bool wait) {
  const std::string path = directory_ + "/" + StoredName(name);
  const Split& split = splits_.at(name);
  // The job's processes start on different parts, as on different files; first the parts no
  // other process has taken, then, with `wait`, the others', waiting for them or taking them over.
  const std::vector<size_t> order = BuildOrder(split.parts.size(), place_);
  bool all_written = true;
  for (const bool waiting : {false, true}) {
    if (waiting && (!wait || all_written)) break;
    all_written = true;
    for (const size_t k : order) {
      UCP_ASSIGN_OR_RETURN(const bool written, BuildPart(name, k, waiting));
      all_written = all_written && written;
      if (IsRegularFile(path)) return true;  // completed meanwhile
    }
  }
  if (!all_written) return false;  // parts other processes are writing
  Result<std::optional<OwnerLease>> lease =
      Claim(LeasePath(name), wait, [&path] { return IsRegularFile(path); });
  if (!wait && !lease.ok() && lease.status().code() == StatusCode::kFailedPrecondition) {
    return false;  // another process completes it
  }
  UCP_RETURN_IF_ERROR(lease.status());
  if (!*lease) return true;
  // Each part's mark holds the CRC-32 of what it wrote.
  std::vector<StoragePieceCrc> pieces;
  for (size_t k = 0; k < split.parts.size(); ++k) {
    const std::string mark = directory_ + "/" + listed_as_.at(name).part_marks[k];
    UCP_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(mark, kMaxMarkBytes));
    UCP_ASSIGN_OR_RETURN(std::vector<StoragePieceCrc> written, ParsePieceCrcs(text, mark));
    pieces.insert(pieces.end(), written.begin(), written.end());
  }
  UCP_RETURN_IF_ERROR(FinishArchiveParts(plans_.at(name).archives.front(), pieces, split.parts_path,
                                         directory_, BuildOptions())
                          .WithContext("view: build " + path));
  UCP_LOG_INFO("view: built {} from {} parts", path, split.parts.size());
  std::lock_guard guard(mutex_);
  ++built_;
  return true;
}

Result<bool> View::BuildPart(const std::string& name, size_t k, bool wait) {
  const std::string path = directory_ + "/" + StoredName(name);
  const ListedAs& listed = listed_as_.at(name);
  const std::string mark = directory_ + "/" + listed.part_marks[k];
  const auto written = [&path, &mark] { return IsRegularFile(mark) || IsRegularFile(path); };
  if (written()) return true;
  Result<std::optional<OwnerLease>> lease =
      Claim(directory_ + "/" + listed.part_leases[k], wait, written);
  if (!wait && !lease.ok() && lease.status().code() == StatusCode::kFailedPrecondition) {
    return false;  // another process writes it
  }
  UCP_RETURN_IF_ERROR(lease.status());
  if (!*lease) return true;
  const Split& split = splits_.at(name);
  const ArchivePart& part = split.parts[k];
  const std::string where = "view: build part " + std::to_string(k) + " of " + path;
  UCP_RETURN_IF_ERROR(
      CreateDirectories(std::filesystem::path(split.parts_path).parent_path().string())
          .WithContext(where));
  Result<std::vector<StoragePieceCrc>> pieces = ExecuteArchivePart(
      plans_.at(name).archives.front(), part, *index_, tag_dir_, split.parts_path, BuildOptions());
  if (!pieces.ok()) return pieces.status().WithContext(where);
  // Marked, with the CRC-32 of each piece it wrote, only once its bytes are synced: a mark is a
  // promise to the process that completes the file.
  UCP_RETURN_IF_ERROR(WriteFileAtomically(mark, PieceCrcsText(*pieces)).WithContext(where));
  UCP_LOG_INFO("view: built part {} of {} (bytes [{}, {}) of its storages)", k, path, part.begin,
               part.end);
  std::lock_guard guard(mutex_);
  ++parts_built_;
  return true;
}

Result<std::string> View::Describe(const std::string& name) {
  UCP_ASSIGN_OR_RETURN(const OutputPlan* plan, PlanOf(name));
  {
    std::lock_guard lock(mutex_);
    if (ready_.contains(name)) return directory_ + "/" + StoredName(name);
    if (const auto known = placeholders_.find(name); known != placeholders_.end()) {
      return known->second;
    }
  }
  // The verdict once per process; after it, a stat costs no system call of ucp's.
  if (!verdict_read_) {
    if (const std::optional<Status> verdict = ReadVerdict()) {
      UCP_RETURN_IF_ERROR(*verdict);
      if (whole_job_) {  // the job's view is complete: its files are what this process serves
        std::lock_guard lock(mutex_);
        ready_ = names_;
        return directory_ + "/" + StoredName(name);
      }
    }
    verdict_read_ = true;
  }
  UCP_ASSIGN_OR_RETURN(const std::optional<uint64_t> size, PlannedFileSize(*plan, *index_));
  if (!size) return Materialize(name);  // a size the plan cannot tell: no placeholder
  std::string placeholder = directory_ + "/.planned/" + StoredName(name);
  std::lock_guard lock(mutex_);
  placeholders_[name] = placeholder;
  return placeholder;
}

uint64_t View::built() const {
  std::lock_guard lock(mutex_);
  return built_;
}

uint64_t View::parts_built() const {
  std::lock_guard lock(mutex_);
  return parts_built_;
}

}  // namespace ucp::hooks
