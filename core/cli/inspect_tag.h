// `ucp inspect TAGDIR [--json]`: a checkpoint tag as its atom index describes it (the saved index
// when it still matches the files, or the index over its atoms store once the framework's files
// are gone, else one built on the spot).
//
// The --json form is a contract:
//   {"tag_dir", "tag", "index": "saved"|"built", "sources": "framework files"|"atoms store",
//    "framework": {"name", "version"}, "adapter": {"name", "schema"},
//    "topology": {"dp", "tp", "pp", "world", "zero_stage"},
//    "files": {"count", "bytes"},   (over an atoms store: the store's files)
//    "groups": [{"params": [names in the framework's order], "hyperparameters": {..},
//                "scalars": {..}}],
//    "states": {STATE: {"atoms", "bytes"}},
//    "atoms": [{"param", "state", "dtype", "shape", "fragments": count, "bytes"}]}
//
// Thread-safety: single-threaded (prints to stdout).
#pragma once

#include <string>

namespace ucp::cli {

// Prints the tag at `dir`; returns the exit status (errors printed as `ucp inspect: ...`).
int InspectTag(const std::string& dir, bool json);

}  // namespace ucp::cli
