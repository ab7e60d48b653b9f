#include "core/util/path.h"

#include <vector>

namespace ucp {

std::string LexicallyNormal(std::string_view path) {
  if (path.empty() || path.front() != '/') return {};
  std::vector<std::string_view> parts;
  size_t pos = 0;
  while (pos < path.size()) {
    const size_t slash = path.find('/', pos);
    const size_t end = slash == std::string_view::npos ? path.size() : slash;
    const std::string_view part = path.substr(pos, end - pos);
    if (part == "..") {
      if (!parts.empty()) parts.pop_back();
    } else if (!part.empty() && part != ".") {
      parts.push_back(part);
    }
    pos = end + 1;
  }
  // The result is never longer than the input (plus the root slash): fill it in place.
  std::string out(path.size() + 1, '/');
  size_t length = 0;
  for (const std::string_view part : parts) {
    out[length++] = '/';
    part.copy(out.data() + length, part.size());
    length += part.size();
  }
  out.resize(length == 0 ? 1 : length);
  return out;
}

std::string JoinAndNormalize(std::string_view base, std::string_view path) {
  if (!path.empty() && path.front() == '/') return LexicallyNormal(path);
  std::string joined(base);
  joined += '/';
  joined += path;
  return LexicallyNormal(joined);
}

bool IsNormalRelativePath(std::string_view path) {
  if (path.empty()) return false;
  size_t pos = 0;
  while (pos <= path.size()) {
    const size_t slash = path.find('/', pos);
    const size_t end = slash == std::string_view::npos ? path.size() : slash;
    const std::string_view part = path.substr(pos, end - pos);
    if (part.empty() || part == "." || part == "..") return false;
    pos = end + 1;
  }
  return true;
}

}  // namespace ucp
