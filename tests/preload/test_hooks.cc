// TEST ONLY: installs hooks that the preload tests observe. Linked into libucp_test_hooks.so
// (the same objects as libucp.so plus this file); never part of libucp.so.
//
//   UCP_TEST_SUBSTITUTE="/abs/a=/abs/b;/abs/c=/abs/d": a ServePolicy serving a from b, c from d.
//   UCP_TEST_TRACK_DIR=/abs/dir and UCP_TEST_EVENTS=/abs/file: a SaveObserver that tracks every
//   file written under dir and appends one line per file to the events file when its last fd
//   closes: "close <path> seq=<bytes written at the file position> positioned=<bytes written
//   at explicit offsets> nonseq=<0|1> syncs=<n>", and one line per rename under dir:
//   "rename <from> <to>".

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "hooks/events.h"

namespace {

class MapPolicy : public ucp::hooks::ServePolicy {
 public:
  explicit MapPolicy(std::map<std::string, std::string> map) : map_(std::move(map)) {}
  ucp::hooks::ServeDecision Resolve(std::string_view path) override {
    const auto it = map_.find(std::string(path));
    if (it == map_.end()) return {};
    return {ucp::hooks::ServeDecision::Kind::kSubstitute, it->second};
  }
  std::optional<ucp::hooks::ListingChange> ChangeListing(std::string_view) override {
    return std::nullopt;
  }

 private:
  const std::map<std::string, std::string> map_;
};

class EventLog : public ucp::hooks::SaveObserver {
 public:
  EventLog(std::string dir, std::string events) : dir_(dir + "/"), events_(std::move(events)) {}

  bool OnOpenForWrite(int fd, std::string_view path, bool, bool) override {
    if (path.substr(0, dir_.size()) != dir_) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    auto file = std::make_shared<File>();
    file->path = path;
    fds_[fd] = file;
    return true;
  }
  void OnWriteBegin(int, int64_t offset, const struct iovec*, int, size_t) override {
    begun_offset_ = offset;
  }
  void OnWriteEnd(int fd, ssize_t ret) override {
    if (ret > 0) Add(fd, begun_offset_, static_cast<size_t>(ret));
  }
  void OnNonSequential(int fd) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = fds_.find(fd); it != fds_.end()) it->second->nonseq = true;
  }
  void OnDup(int old_fd, int new_fd) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = fds_.find(old_fd); it != fds_.end()) fds_[new_fd] = it->second;
  }
  void OnClose(int fd) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = fds_.find(fd);
    if (it == fds_.end()) return;
    const std::shared_ptr<File> file = it->second;
    fds_.erase(it);
    if (file.use_count() > 1) return;
    Append("close " + file->path + " seq=" + std::to_string(file->seq) +
           " positioned=" + std::to_string(file->positioned) +
           " nonseq=" + (file->nonseq ? "1" : "0") + " syncs=" + std::to_string(file->syncs));
  }
  void OnSync(int fd) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = fds_.find(fd); it != fds_.end()) ++it->second->syncs;
  }
  void OnRename(std::string_view from, std::string_view to) override {
    if (from.substr(0, dir_.size()) != dir_) return;
    std::lock_guard<std::mutex> lock(mutex_);
    Append("rename " + std::string(from) + " " + std::string(to));
  }

 private:
  struct File {
    std::string path;
    size_t seq = 0;
    size_t positioned = 0;
    bool nonseq = false;
    int syncs = 0;
  };

  void Add(int fd, int64_t offset, size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = fds_.find(fd);
    if (it == fds_.end()) return;
    (offset < 0 ? it->second->seq : it->second->positioned) += size;
  }
  // Runs inside ucp's reentrancy guard: these libc calls pass straight through.
  void Append(const std::string& line) {
    const int fd = ::open(events_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) return;
    const std::string text = line + "\n";
    if (::write(fd, text.data(), text.size()) < 0) {
      ::close(fd);
      return;
    }
    ::close(fd);
  }

  // The offset of the write this thread began: its end reports only what it returned.
  static inline thread_local int64_t begun_offset_ = -1;
  const std::string dir_;
  const std::string events_;
  std::mutex mutex_;
  std::map<int, std::shared_ptr<File>> fds_;
};

std::map<std::string, std::string> ParsePairs(const char* text) {
  std::map<std::string, std::string> map;
  std::string rest = text == nullptr ? "" : text;
  while (!rest.empty()) {
    const size_t end = rest.find(';');
    const std::string pair = rest.substr(0, end);
    const size_t equals = pair.find('=');
    if (equals != std::string::npos) map[pair.substr(0, equals)] = pair.substr(equals + 1);
    rest = end == std::string::npos ? "" : rest.substr(end + 1);
  }
  return map;
}

__attribute__((constructor)) void InstallTestHooks() {
  if (const char* pairs = ::getenv("UCP_TEST_SUBSTITUTE")) {
    ucp::hooks::SetServePolicy(new MapPolicy(ParsePairs(pairs)));
  }
  const char* dir = ::getenv("UCP_TEST_TRACK_DIR");
  const char* events = ::getenv("UCP_TEST_EVENTS");
  if (dir != nullptr && events != nullptr) ucp::hooks::SetSaveObserver(new EventLog(dir, events));
}

}  // namespace
