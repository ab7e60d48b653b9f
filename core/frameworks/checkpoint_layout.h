// Checkpoint layouts: which written paths belong to a framework's checkpoint, and what they mean.
//
// One CheckpointLayout per checkpoint schema family (DeepSpeed, Megatron-LM, torch DCP) behind one
// interface, registered by name in a LayoutRegistry. A layout looks at names only: it never
// touches the file system, so recognising a path costs a few string comparisons, and the caller
// decides what to do with a match (track it, read a commit signal, check the tag exists).
//
// Names recognised (`<tag>` is the tag directory, where `<tag>/.ucp/` lives):
//   deepspeed  data    <save>/<tag>/mp_rank_XX_model_states.pt
//                      <save>/<tag>/zero_pp_rank_N_mp_rank_XX_model_states.pt
//                      <save>/<tag>/layer_XX-model_states.pt, layer_XX-model_YY-model_states.pt
//                      <save>/<tag>/[bf16_]zero_pp_rank_N_mp_rank_XX_optim_states.pt
//                      <save>/<tag>/expp_rank_N_mp_rank_XX_optim_states.pt
//                      <save>/<tag>/layer_N_expert_M_mp_rank_XX_model_states.pt
//              commit  <save>/latest, whose content is the tag's name
//   megatron   data <save>/iter_NNNNNNN/mp_rank_XX[_YYY[_ZZZ]]/{model_optim_rng,distrib_optim}.pt
//                      (`release` in place of iter_NNNNNNN too)
//              commit  <save>/latest_checkpointed_iteration.txt, content an iteration or "release"
//   dcp        data    <tag>/*.distcp
//              commit  <tag>/.metadata (DCP writes .metadata.tmp and renames it)
//
// Thread-safety: a CheckpointLayout is immutable; its methods may be called from any thread. A
// LayoutRegistry is filled at start-up (Register), then only read, from any thread.
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/util/status.h"

namespace ucp {

enum class FileRole {
  kData,          // a file of the checkpoint's contents, journaled when closed
  kCommitSignal,  // the framework's "this tag is complete" marker
};

// "data" or "commit".
std::string_view FileRoleName(FileRole role);

// What a recognised path is. Paths are absolute and lexically normal.
struct PathMatch {
  std::string framework;  // the layout's name()
  FileRole role = FileRole::kData;
  std::string save_dir;  // the directory that holds the tags
  // The tag directory. For a DeepSpeed or Megatron commit signal it is only known from the
  // signal's content (ResolveCommit), and is empty here.
  std::string tag_dir;
};

// The tag a commit signal commits.
struct CommitTarget {
  std::string tag_dir;
  std::string tag;  // the tag's name: the last component of tag_dir
};

// The last path components a layout recognises (CheckpointLayout::FileNames): a path whose last
// component is none of `names` and ends in none of `suffixes` is never one of its names. Neither
// holds an empty string or a '/' (the filter compares them with a path's last component only).
struct FileNamePatterns {
  std::vector<std::string> names;     // whole components, e.g. "latest"
  std::vector<std::string> suffixes;  // endings, e.g. "_states.pt"
};

class CheckpointLayout {
 public:
  virtual ~CheckpointLayout() = default;

  // The registry key ("deepspeed", "megatron", "dcp"); also PathMatch::framework.
  virtual std::string_view name() const = 0;

  // Classifies an absolute, lexically normal path; nullopt when it is not one of this layout's
  // names.
  virtual std::optional<PathMatch> Recognise(std::string_view path) const = 0;

  // Every last path component one of this layout's names can have, whole or by its ending. The
  // registry merges them into the name filter that every open and stat in the process runs.
  virtual FileNamePatterns FileNames() const = 0;

  // For a kCommitSignal match from Recognise(): the tag it commits, given the signal file's
  // content (ignored by layouts whose signal is the file's existence). InvalidArgument when the
  // content names no valid tag.
  virtual Result<CommitTarget> ResolveCommit(const PathMatch& signal,
                                             std::string_view content) const = 0;
};

// The directories under which checkpoint activity counts (UCP_ROOTS). An empty set means
// everywhere.
class RootSet {
 public:
  // Every root must be absolute; each is lexically normalised ("/a/b/" and "/a/./b" are "/a/b").
  static Result<RootSet> Create(const std::vector<std::string>& roots);
  RootSet() = default;  // everywhere

  // True when the set is empty, or `path` is one of the roots or lies below one.
  bool Contains(std::string_view path) const;
  const std::vector<std::string>& roots() const { return roots_; }

 private:
  explicit RootSet(std::vector<std::string> roots) : roots_(std::move(roots)) {}
  std::vector<std::string> roots_;
};

class LayoutRegistry {
 public:
  LayoutRegistry() = default;
  LayoutRegistry(const LayoutRegistry&) = delete;
  LayoutRegistry& operator=(const LayoutRegistry&) = delete;

  // The registry holding every built-in layout (deepspeed, megatron, dcp). Never destroyed.
  static const LayoutRegistry& Builtin();

  // Adds a layout. InvalidArgument when one with the same name is already registered, or when
  // one of its FileNames() is empty or holds a '/'.
  Status Register(std::unique_ptr<CheckpointLayout> layout);

  // The layout registered under `name`, or nullptr.
  const CheckpointLayout* Find(std::string_view name) const;

  // The first registered layout's match for `path`, if `path` lies in `roots`.
  std::optional<PathMatch> Recognise(std::string_view path, const RootSet& roots) const;

  // True when some registered layout may match `path` (absolute, relative, or a bare file name)
  // by its last component: that is one of their FileNames() or ends in one. A path ending in
  // '/', "." or ".." names a directory, which no layout's file is. Most paths are turned away by
  // their last byte alone, before the last '/' is looked for, since this runs on every open and
  // stat of the process.
  bool MayMatchPath(std::string_view path) const {
    return !path.empty() && last_bytes_[static_cast<unsigned char>(path.back())] &&
           MatchesFileName(path.substr(path.rfind('/') + 1));
  }

 private:
  // MayMatchPath past the last-byte check, on the last component: a whole name or a suffix of some
  // layout.
  bool MatchesFileName(std::string_view file_name) const;

  std::vector<std::unique_ptr<CheckpointLayout>> layouts_;
  // The union of the layouts' FileNames(), and the last bytes they can end in.
  FileNamePatterns file_names_;
  std::array<bool, 256> last_bytes_{};
};

// The built-in layouts, for registries assembled by hand.
std::unique_ptr<CheckpointLayout> MakeDeepSpeedLayout();
std::unique_ptr<CheckpointLayout> MakeMegatronLayout();
std::unique_ptr<CheckpointLayout> MakeDcpLayout();

}  // namespace ucp
