// A checkpoint tag as the commands see it: its directory, the adapter that reads it, and its atom
// index, either the one saved in the tag (`ucp index`) or one built on the spot.
//
// Thread-safety: OpenTag may run concurrently for different tags; a Tag is immutable.
#pragma once

#include <string>

#include "core/format/atom_index.h"
#include "core/frameworks/framework_adapter.h"

namespace ucp::cli {

struct Tag {
  std::string dir;   // as given, trailing slashes removed
  std::string name;  // the directory's last component ("global_step5")
  const FrameworkAdapter* adapter = nullptr;
  AtomIndex index;
  bool saved_index = false;  // index read from <dir>/.ucp/index.json
  bool from_store = false;   // the framework's files are gone: `index` reads the atoms store
};

// <tag_dir>/.ucp/index.json
std::string IndexPath(const std::string& tag_dir);

// Opens `dir`. With `use_saved_index`, a saved index is used when it parses, validates, names a
// registered adapter and every file it lists has the size it records; when the framework's files
// are gone and the index has an atoms store whose files are all there, `index` is the index over
// the store (AtomIndex::OverStore). Anything else (no index, a stale or damaged one) means the
// tag's adapter is detected and the index built, never trusted.
// kNotFound when `dir` is not a directory or no adapter recognises it.
[[nodiscard]] Result<Tag> OpenTag(const std::string& dir, const IndexOptions& options,
                                  bool use_saved_index);

}  // namespace ucp::cli
