// Lexical path helpers: pure string manipulation, no file system access.
//
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <string_view>

namespace ucp {

// Normalises an absolute path lexically: repeated slashes collapse, "." components vanish, ".."
// removes the previous component (and stays at "/" at the root), and no trailing slash remains
// except for "/" itself. Symbolic links are not resolved. `path` must start with '/'; anything
// else returns an empty string.
std::string LexicallyNormal(std::string_view path);

// Joins `base` (absolute) and `path`: `path` itself when it is absolute, otherwise
// "<base>/<path>", then normalised as LexicallyNormal does. Empty when `base` is not absolute
// and `path` is relative.
std::string JoinAndNormalize(std::string_view base, std::string_view path);

// True when `path` is relative and already normal, so that joining it to a directory stays inside
// that directory: non-empty, no leading or trailing '/', and no empty, "." or ".." component.
bool IsNormalRelativePath(std::string_view path);

}  // namespace ucp
