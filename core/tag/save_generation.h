// The save generation of a tag: which bytes the tag's newest complete save consisted of, so that
// the next commit of the same tag tells "this save's close" from "a file this save has not
// rewritten yet" by equality of stat(2) stamps, never by comparing clocks of different nodes.
//
// Why it is needed: DeepSpeed's rank 0 writes `latest` as soon as its own files are closed; another
// rank may not even have reopened its file of a tag being saved again. That file's bytes and its
// journal record (of the earlier save) still agree, so only knowing that an earlier commit already
// consisted of exactly those bytes keeps them out of this save.
//
// Layout (normative; README "Save generation"):
//   <tag>/.ucp/generation.json  one JSON object, replaced whole (written to a temporary name, then
//                               renamed) by the process whose commit listener (the durable commit
//                               or the index builder) found every file of a commit closed:
//     "v"       1
//     "commit"  the commit's id (NewCommitId), compared only for equality
//     "files"   array of {"path", "size", "ino", "mtime_ns"}: each file of that save, as the
//               journal's close record of it says (core/tag/journal.h)
//
// Thread-safety: free functions over files; concurrent writers of one tag leave one of their
// records whole.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tag/journal.h"
#include "core/util/status.h"

namespace ucp {

struct SaveGeneration {
  std::string commit;
  std::map<std::string, FileOnDisk> files;  // path relative to the tag → its bytes' stamp
};

// "<tag_dir>/.ucp/generation.json".
std::string SaveGenerationPath(const std::string& tag_dir);

// A commit id no other commit has: "<host>.<pid>.<n>", n counting this process's commits.
std::string NewCommitId();

// The tag's record; nullopt when it has none. kCorrupt names the file and the member.
Result<std::optional<SaveGeneration>> ReadSaveGeneration(const std::string& tag_dir);
// Replaces the tag's record (creating .ucp/ when missing), unless it holds exactly this one.
Status WriteSaveGeneration(const std::string& tag_dir, const SaveGeneration& generation);

// The files of a save, matched against the journal.
struct SaveFiles {
  std::unordered_map<std::string, const JournalRecord*> closes;  // path → this save's close
  std::vector<std::string> missing;                              // in `expected`'s order
};

// What tells the closes of the save committed as `commit` from those of earlier saves of the tag.
struct SaveBounds {
  std::string commit;
  // The tag's record: bytes another commit consisted of are not this save's.
  std::optional<SaveGeneration> earlier;
  // A close journaled on `host` before `host_start_ns` (CLOCK_REALTIME) is not this save's: it
  // covers what no generation records, the files of a killed run that never committed. Only
  // records of that host are compared with it, so two nodes' clocks never meet. Empty: none.
  std::string host;
  int64_t host_start_ns = 0;
  // A close whose record names a job other than `job` (a run's, RunJob) is another run's: a killed
  // run of the job, on any node, that never committed. Only records that name a job are compared
  // with it. Empty: none.
  std::string job;
};

// The bounds of `commit` as this process sees them: this host, the time this library was
// loaded, and `job`, this process's run of its job (hooks' RunJob). Only for a process that the
// job's other processes met before they saved (a trainer's rank after its rendezvous, as the
// durable commit's is): a close on this host earlier than that is then an earlier run's.
SaveBounds BoundsOfThisProcess(std::string commit, std::optional<SaveGeneration> earlier,
                               std::string job);

// The closes of `expected` that make up the save `bounds` describe: each path's close that
// describes the file on disk now (ClosesOnDisk), unless `bounds` say it is an earlier save's.
SaveFiles MatchSave(const std::vector<JournalRecord>& records,
                    const std::vector<std::string>& expected, const SaveBounds& bounds,
                    const FileOnDiskLookup& on_disk);

// The record that says `closes` made up the save committed as `commit`.
SaveGeneration GenerationOf(const std::string& commit,
                            const std::unordered_map<std::string, const JournalRecord*>& closes);

}  // namespace ucp
