// Directory streams. When the serve policy changes a directory's listing (a tag served at another
// topology, DESIGN.md §3 load step 3), the stream leaves out the hidden names and, after the
// real entries, returns the added ones as regular files; everything else passes through.
// rewinddir restarts both parts; closedir forgets the stream. telldir/seekdir positions refer to
// the real entries only.

#include <dirent.h>
#include <fcntl.h>
#include <string.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "hooks/events.h"
#include "interpose/dispatch.h"
#include "interpose/gate.h"
#include "interpose/real.h"

namespace {

// A stream whose listing the policy changed.
struct Listing {
  std::set<std::string, std::less<>> hide;
  std::vector<std::string> add;
  std::set<std::string, std::less<>> to_add;  // `add` as a set
  // Added names the real listing turned out to hold: returned once, by the real part.
  std::set<std::string, std::less<>> seen;
  bool real_done = false;
  size_t next_added = 0;
  // The entry readdir / readdir64 last returned for an added name, valid until the next call on
  // the stream (readdir's own contract).
  struct dirent entry;
  struct dirent64 entry64;
};

// Streams with a changed listing, by DIR*. Never destroyed: wrappers may run during teardown.
struct Listings {
  std::mutex mutex;
  std::map<DIR*, std::unique_ptr<Listing>> by_dir;
};

Listings& Table() {
  static Listings* const table = new Listings;
  return *table;
}

// How many streams have a changed listing: 0 lets readdir skip the table entirely.
std::atomic<size_t> g_changed{0};

void Remember(DIR* dir, std::optional<ucp::hooks::ListingChange> change) {
  if (!change || (change->hide.empty() && change->add.empty())) return;
  auto listing = std::make_unique<Listing>();
  listing->hide.insert(change->hide.begin(), change->hide.end());
  for (std::string& name : change->add) {
    // A name a dirent cannot hold cannot be listed.
    if (name.empty() || name.size() >= sizeof(listing->entry.d_name) ||
        name.find('/') != std::string::npos || !listing->to_add.insert(name).second) {
      continue;
    }
    listing->add.push_back(std::move(name));
  }
  Listings& table = Table();
  std::lock_guard lock(table.mutex);
  if (table.by_dir.insert_or_assign(dir, std::move(listing)).second) g_changed.fetch_add(1);
}

Listing* Find(DIR* dir) {
  Listings& table = Table();
  std::lock_guard lock(table.mutex);
  const auto found = table.by_dir.find(dir);
  return found == table.by_dir.end() ? nullptr : found->second.get();
}

void Forget(DIR* dir) {
  Listings& table = Table();
  std::lock_guard lock(table.mutex);
  if (table.by_dir.erase(dir) > 0) g_changed.fetch_sub(1);
}

// A stable, nonzero inode number for an added name (scandir and glob skip d_ino 0 on some
// systems; the real inode is the view file's, which stat reports).
ino64_t NameInode(std::string_view name) {
  uint64_t hash = 1469598103934665603ULL;
  for (const char c : name) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  return hash == 0 ? 1 : hash;
}

template <typename Entry>
Entry* Fill(Entry& entry, const std::string& name) {
  memset(&entry, 0, sizeof(entry));
  entry.d_ino = NameInode(name);
  entry.d_reclen = sizeof(entry);
  entry.d_type = DT_REG;
  memcpy(entry.d_name, name.data(), name.size());
  return &entry;
}

// The next entry of a changed stream: the real ones not hidden, then the added ones. Keeps the
// real readdir's errno contract: unchanged at the end, set on an error.
template <typename Entry, typename Real>
Entry* Next(DIR* dir, Listing& listing, Entry& storage, Real real) {
  while (!listing.real_done) {
    const int saved_errno = errno;
    errno = 0;
    Entry* entry = real(dir);
    if (entry == nullptr) {
      if (errno != 0) return nullptr;
      errno = saved_errno;
      listing.real_done = true;
      break;
    }
    errno = saved_errno;
    const std::string_view name(entry->d_name);
    if (listing.hide.contains(name)) continue;
    if (listing.to_add.contains(name)) {
      try {
        listing.seen.emplace(name);
      } catch (...) {
        // Out of memory: the name may be listed twice.
      }
    }
    return entry;
  }
  while (listing.next_added < listing.add.size()) {
    const std::string& name = listing.add[listing.next_added++];
    if (!listing.seen.contains(name)) return Fill(storage, name);
  }
  return nullptr;
}

DIR* Opened(DIR* dir, int dirfd, const char* path) {
  if (dir == nullptr || !ucp::InterceptGate() || !ucp::dispatch::MayServe()) return dir;
  ucp::ReentrancyGuard guard;
  const ucp::ErrnoPreserver keep;
  try {
    Remember(dir, ucp::dispatch::ChangeListing(dirfd, path));
  } catch (...) {
    // Out of memory: the stream lists the real entries.
  }
  return dir;
}

}  // namespace

extern "C" UCP_EXPORT DIR* opendir(const char* path) {
  return Opened(ucp::real::opendir()(path), AT_FDCWD, path);
}

extern "C" UCP_EXPORT DIR* fdopendir(int fd) { return Opened(ucp::real::fdopendir()(fd), fd, "."); }

extern "C" UCP_EXPORT struct dirent* readdir(DIR* dir) {
  if (g_changed.load(std::memory_order_relaxed) == 0 || !ucp::InterceptGate()) {
    return ucp::real::readdir()(dir);
  }
  ucp::ReentrancyGuard guard;
  Listing* listing = Find(dir);
  if (listing == nullptr) return ucp::real::readdir()(dir);
  return Next(dir, *listing, listing->entry, ucp::real::readdir());
}

extern "C" UCP_EXPORT struct dirent64* readdir64(DIR* dir) {
  if (g_changed.load(std::memory_order_relaxed) == 0 || !ucp::InterceptGate()) {
    return ucp::real::readdir64()(dir);
  }
  ucp::ReentrancyGuard guard;
  Listing* listing = Find(dir);
  if (listing == nullptr) return ucp::real::readdir64()(dir);
  return Next(dir, *listing, listing->entry64, ucp::real::readdir64());
}

extern "C" UCP_EXPORT void rewinddir(DIR* dir) __THROW {
  ucp::real::rewinddir()(dir);
  if (g_changed.load(std::memory_order_relaxed) == 0 || !ucp::InterceptGate()) return;
  ucp::ReentrancyGuard guard;
  const ucp::ErrnoPreserver keep;
  if (Listing* listing = Find(dir); listing != nullptr) {
    listing->real_done = false;
    listing->next_added = 0;
    listing->seen.clear();
  }
}

extern "C" UCP_EXPORT int closedir(DIR* dir) {
  // Forgotten whatever the gate says: the address may be reused by any later stream.
  if (g_changed.load(std::memory_order_relaxed) != 0) {
    ucp::ReentrancyGuard guard;
    Forget(dir);
  }
  return ucp::real::closedir()(dir);
}
