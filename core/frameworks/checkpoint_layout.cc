#include "core/frameworks/checkpoint_layout.h"

#include <filesystem>
#include <regex>

#include "core/frameworks/deepspeed/file_names.h"

namespace ucp {
namespace {

// "/a/b/c" → {"/a/b", "c"}; the root's parent is "" (no save directory above it).
std::pair<std::string_view, std::string_view> SplitLast(std::string_view path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) return {std::string_view(), path};
  return {path.substr(0, slash), path.substr(slash + 1)};
}

bool EndsWith(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

bool Matches(const std::regex& pattern, std::string_view text) {
  return std::regex_match(text.begin(), text.end(), pattern);
}

// A tag named by a commit signal must be one directory entry: not empty, no '/', not "." or "..".
bool IsEntryName(std::string_view name) {
  return !name.empty() && name.size() <= 255 && name.find('/') == std::string_view::npos &&
         name.find('\0') == std::string_view::npos && name != "." && name != "..";
}

// DeepSpeed and Megatron write the tag with or without a trailing newline.
std::string_view TrimWhitespace(std::string_view text) {
  const char* kSpace = " \t\r\n";
  const size_t first = text.find_first_not_of(kSpace);
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(kSpace) - first + 1);
}

class DeepSpeedLayout final : public CheckpointLayout {
 public:
  std::string_view name() const override { return "deepspeed"; }

  std::optional<PathMatch> Recognise(std::string_view path) const override {
    const auto [dir, file] = SplitLast(path);
    if (dir.empty()) return std::nullopt;
    if (file == deepspeed::kLatestName) {
      return PathMatch{std::string(name()), FileRole::kCommitSignal, std::string(dir), {}};
    }
    // The cheap test first: this runs on every file opened for writing.
    if (!EndsWith(file, deepspeed::kStatesSuffix)) return std::nullopt;
    if (!deepspeed::ParseFileName(file)) return std::nullopt;
    const auto [save_dir, tag] = SplitLast(dir);
    if (save_dir.empty()) return std::nullopt;
    return PathMatch{std::string(name()), FileRole::kData, std::string(save_dir), std::string(dir)};
  }

  FileNamePatterns FileNames() const override {
    return {{std::string(deepspeed::kLatestName)}, {std::string(deepspeed::kStatesSuffix)}};
  }

  Result<CommitTarget> ResolveCommit(const PathMatch& signal,
                                     std::string_view content) const override {
    const std::string_view tag = TrimWhitespace(content);
    if (!IsEntryName(tag)) {
      return Status::InvalidArgument("deepspeed: " + signal.save_dir + "/" +
                                     std::string(deepspeed::kLatestName) +
                                     ": content is not a tag name");
    }
    return CommitTarget{signal.save_dir + "/" + std::string(tag), std::string(tag)};
  }
};

class MegatronLayout final : public CheckpointLayout {
 public:
  std::string_view name() const override { return "megatron"; }

  std::optional<PathMatch> Recognise(std::string_view path) const override {
    const auto [dir, file] = SplitLast(path);
    if (dir.empty()) return std::nullopt;
    if (file == "latest_checkpointed_iteration.txt") {
      return PathMatch{std::string(name()), FileRole::kCommitSignal, std::string(dir), {}};
    }
    if (file != "model_optim_rng.pt" && file != "distrib_optim.pt") return std::nullopt;
    const auto [tag_dir, rank_dir] = SplitLast(dir);
    if (!Matches(rank_dir_, rank_dir)) return std::nullopt;
    const auto [save_dir, tag] = SplitLast(tag_dir);
    if (save_dir.empty() || !(tag == "release" || Matches(iteration_dir_, tag))) {
      return std::nullopt;
    }
    return PathMatch{std::string(name()), FileRole::kData, std::string(save_dir),
                     std::string(tag_dir)};
  }

  FileNamePatterns FileNames() const override {
    return {{"latest_checkpointed_iteration.txt", "model_optim_rng.pt", "distrib_optim.pt"}, {}};
  }

  Result<CommitTarget> ResolveCommit(const PathMatch& signal,
                                     std::string_view content) const override {
    const std::string_view text = TrimWhitespace(content);
    std::string tag;
    if (text == "release") {
      tag = "release";
    } else if (!text.empty() && text.size() <= 18 &&
               text.find_first_not_of("0123456789") == std::string_view::npos) {
      // Megatron's get_checkpoint_name: iter_{:07d}.
      tag = std::string(text);
      if (tag.size() < 7) tag.insert(0, 7 - tag.size(), '0');
      tag.insert(0, "iter_");
    } else {
      return Status::InvalidArgument("megatron: " + signal.save_dir +
                                     "/latest_checkpointed_iteration.txt: content is neither an "
                                     "iteration nor \"release\"");
    }
    return CommitTarget{signal.save_dir + "/" + tag, tag};
  }

 private:
  // mp_rank_{tp:02d}, then _{pp:03d} with pipeline parallelism, then _{ep:03d} with experts.
  const std::regex rank_dir_{"mp_rank_[0-9]{2}(_[0-9]{3}){0,2}", std::regex::optimize};
  const std::regex iteration_dir_{"iter_[0-9]{7,}", std::regex::optimize};
};

class DcpLayout final : public CheckpointLayout {
 public:
  std::string_view name() const override { return "dcp"; }

  std::optional<PathMatch> Recognise(std::string_view path) const override {
    const auto [dir, file] = SplitLast(path);
    const auto [save_dir, tag] = SplitLast(dir);
    if (dir.empty() || save_dir.empty()) return std::nullopt;
    FileRole role;
    if (file == ".metadata") {
      role = FileRole::kCommitSignal;
    } else if (EndsWith(file, ".distcp") && file.size() > std::string_view(".distcp").size()) {
      role = FileRole::kData;
    } else {
      return std::nullopt;
    }
    return PathMatch{std::string(name()), role, std::string(save_dir), std::string(dir)};
  }

  FileNamePatterns FileNames() const override { return {{".metadata"}, {".distcp"}}; }

  Result<CommitTarget> ResolveCommit(const PathMatch& signal, std::string_view) const override {
    return CommitTarget{signal.tag_dir, std::string(SplitLast(signal.tag_dir).second)};
  }
};

}  // namespace

std::string_view FileRoleName(FileRole role) { return role == FileRole::kData ? "data" : "commit"; }

Result<RootSet> RootSet::Create(const std::vector<std::string>& roots) {
  std::vector<std::string> normal;
  for (const std::string& root : roots) {
    if (root.empty() || root[0] != '/') {
      return Status::InvalidArgument("roots: \"" + root + "\": not an absolute path");
    }
    std::string text = std::filesystem::path(root).lexically_normal().string();
    while (text.size() > 1 && text.back() == '/') text.pop_back();
    normal.push_back(std::move(text));
  }
  return RootSet(std::move(normal));
}

bool RootSet::Contains(std::string_view path) const {
  if (roots_.empty()) return true;
  for (const std::string& root : roots_) {
    if (root == "/") return true;
    if (path.size() >= root.size() && path.substr(0, root.size()) == root &&
        (path.size() == root.size() || path[root.size()] == '/')) {
      return true;
    }
  }
  return false;
}

const LayoutRegistry& LayoutRegistry::Builtin() {
  static const LayoutRegistry* registry = [] {
    auto* built = new LayoutRegistry();
    // Distinct names: registering cannot fail.
    (void)built->Register(MakeDeepSpeedLayout());
    (void)built->Register(MakeMegatronLayout());
    (void)built->Register(MakeDcpLayout());
    return built;
  }();
  return *registry;
}

Status LayoutRegistry::Register(std::unique_ptr<CheckpointLayout> layout) {
  if (Find(layout->name()) != nullptr) {
    return Status::InvalidArgument("layouts: \"" + std::string(layout->name()) +
                                   "\": registered twice");
  }
  FileNamePatterns patterns = layout->FileNames();
  for (const auto* list : {&patterns.names, &patterns.suffixes}) {
    for (const std::string& pattern : *list) {
      if (pattern.empty() || pattern.find('/') != std::string::npos) {
        return Status::InvalidArgument("layouts: \"" + std::string(layout->name()) +
                                       "\": file name pattern \"" + pattern +
                                       "\" is empty or holds a '/'");
      }
    }
  }
  for (std::string& name : patterns.names) {
    last_bytes_[static_cast<unsigned char>(name.back())] = true;
    file_names_.names.push_back(std::move(name));
  }
  for (std::string& suffix : patterns.suffixes) {
    last_bytes_[static_cast<unsigned char>(suffix.back())] = true;
    file_names_.suffixes.push_back(std::move(suffix));
  }
  layouts_.push_back(std::move(layout));
  return Status::Ok();
}

const CheckpointLayout* LayoutRegistry::Find(std::string_view name) const {
  for (const auto& layout : layouts_) {
    if (layout->name() == name) return layout.get();
  }
  return nullptr;
}

std::optional<PathMatch> LayoutRegistry::Recognise(std::string_view path,
                                                   const RootSet& roots) const {
  if (!roots.Contains(path)) return std::nullopt;
  for (const auto& layout : layouts_) {
    if (auto match = layout->Recognise(path)) return match;
  }
  return std::nullopt;
}

bool LayoutRegistry::MatchesFileName(std::string_view file_name) const {
  for (const std::string& name : file_names_.names) {
    if (file_name == name) return true;
  }
  for (const std::string& suffix : file_names_.suffixes) {
    if (EndsWith(file_name, suffix)) return true;
  }
  return false;
}

std::unique_ptr<CheckpointLayout> MakeDeepSpeedLayout() {
  return std::make_unique<DeepSpeedLayout>();
}
std::unique_ptr<CheckpointLayout> MakeMegatronLayout() {
  return std::make_unique<MegatronLayout>();
}
std::unique_ptr<CheckpointLayout> MakeDcpLayout() { return std::make_unique<DcpLayout>(); }

}  // namespace ucp
