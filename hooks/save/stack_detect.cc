#include "hooks/save/stack_detect.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <libunwind.h>

#include <atomic>
#include <cstdlib>

#include "core/util/log.h"

namespace ucp::hooks {
namespace {

constexpr int kMaxFrames = 256;

// The entry points of libunwind's local-only x86-64 flavour, the ones its unw_* macros name.
struct Unwinder {
  int (*get_context)(unw_context_t*) = nullptr;
  int (*init_local)(unw_cursor_t*, unw_context_t*) = nullptr;
  int (*step)(unw_cursor_t*) = nullptr;
  int (*get_reg)(unw_cursor_t*, int, unw_word_t*) = nullptr;
  int (*get_proc_name)(unw_cursor_t*, char*, size_t, unw_word_t*) = nullptr;
};

template <typename Fn>
bool Resolve(void* library, const char* name, Fn* out) {
  *out = reinterpret_cast<Fn>(::dlsym(library, name));
  return *out != nullptr;
}

// Loaded once; nullptr when libunwind is not there. Never unloaded.
const Unwinder* LoadUnwinder() {
  static const Unwinder* unwinder = []() -> const Unwinder* {
    void* library = nullptr;
    for (const char* soname : {"libunwind.so.8", "libunwind-x86_64.so.8"}) {
      library = ::dlopen(soname, RTLD_NOW | RTLD_LOCAL);
      if (library != nullptr) break;
    }
    if (library == nullptr) {
      UCP_LOG_WARN("stack: cannot load libunwind.so.8 ({}): no writer matches UCP_DETECT=stack",
                   ::dlerror());
      return nullptr;
    }
    Unwinder loaded;
    if (!Resolve(library, "_Ux86_64_getcontext", &loaded.get_context) ||
        !Resolve(library, "_ULx86_64_init_local", &loaded.init_local) ||
        !Resolve(library, "_ULx86_64_step", &loaded.step) ||
        !Resolve(library, "_ULx86_64_get_reg", &loaded.get_reg) ||
        !Resolve(library, "_ULx86_64_get_proc_name", &loaded.get_proc_name)) {
      UCP_LOG_WARN(
          "stack: libunwind lacks an x86-64 entry point: no writer matches "
          "UCP_DETECT=stack");
      return nullptr;
    }
    return new Unwinder(loaded);
  }();
  return unwinder;
}

std::string Demangle(const char* name) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  if (demangled == nullptr) return std::string();
  std::string text(demangled);
  std::free(demangled);
  return text;
}

// Calls `visit(ip, cursor)` for each frame above this function's caller until it returns false.
template <typename Visit>
void WalkStack(const Unwinder& unwinder, Visit&& visit) {
  unw_context_t context;
  unw_cursor_t cursor;
  if (unwinder.get_context(&context) != 0 || unwinder.init_local(&cursor, &context) != 0) return;
  for (int depth = 0; depth < kMaxFrames && unwinder.step(&cursor) > 0; ++depth) {
    unw_word_t ip = 0;
    if (unwinder.get_reg(&cursor, UNW_REG_IP, &ip) != 0 || ip == 0) return;
    if (!visit(static_cast<uintptr_t>(ip), &cursor)) return;
  }
}

// The frame's function name (mangled), or empty.
std::string ProcName(const Unwinder& unwinder, unw_cursor_t* cursor) {
  char name[1024];
  unw_word_t offset = 0;
  const int ret = unwinder.get_proc_name(cursor, name, sizeof(name), &offset);
  // -UNW_ENOMEM: the name was truncated, and the prefix is still worth matching.
  if (ret != 0 && ret != -UNW_ENOMEM) return std::string();
  name[sizeof(name) - 1] = '\0';
  return name;
}

}  // namespace

std::vector<std::string> CurrentStackSymbols(int max_frames) {
  std::vector<std::string> symbols;
  const Unwinder* unwinder = LoadUnwinder();
  if (unwinder == nullptr) return symbols;
  WalkStack(*unwinder, [&](uintptr_t, unw_cursor_t* cursor) {
    std::string name = ProcName(*unwinder, cursor);
    std::string demangled = Demangle(name.c_str());
    symbols.push_back(demangled.empty() ? std::move(name) : std::move(demangled));
    return static_cast<int>(symbols.size()) < max_frames;
  });
  return symbols;
}

Result<std::unique_ptr<StackDetector>> StackDetector::Create(std::vector<std::string> patterns) {
  if (patterns.empty()) return Status::InvalidArgument("stack patterns: the list is empty");
  for (const std::string& pattern : patterns) {
    if (pattern.empty()) return Status::InvalidArgument("stack patterns: a pattern is empty");
  }
  return std::unique_ptr<StackDetector>(new StackDetector(std::move(patterns)));
}

bool StackDetector::NameMatches(std::string_view name) const {
  for (const std::string& pattern : patterns_) {
    if (name.find(pattern) != std::string_view::npos) return true;
  }
  return false;
}

bool StackDetector::IsCheckpointWriter() {
  const Unwinder* unwinder = LoadUnwinder();
  if (unwinder == nullptr) return false;
  bool found = false;
  WalkStack(*unwinder, [&](uintptr_t ip, unw_cursor_t* cursor) {
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      const auto it = cache_.find(ip);
      if (it != cache_.end()) {
        found = it->second;
        return !found;
      }
    }
    // Symbol lookup is the slow part (it reads symbol tables), so it runs unlocked and once per
    // instruction address.
    const std::string name = ProcName(*unwinder, cursor);
    const bool matches =
        !name.empty() && (NameMatches(name) || NameMatches(Demangle(name.c_str())));
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      cache_.emplace(ip, matches);
    }
    found = matches;
    return !found;
  });
  return found;
}

}  // namespace ucp::hooks
