// Integrity of the files an index reads from: a file's size and whole-file XXH3 against the index
// before any of its bytes are served where the index has no chunk hashes of it (with them, the
// executor checks each chunk as it reads it), and, where a file differs, where the damage lies —
// the torch archive records failing their own CRC-32 (the zip directory's per-record checksum,
// torch's per-tensor checksum in effect) and the atoms whose bytes they hold.
//
// Thread-safety: functions of their arguments; VerifySources runs (and joins) HashTagFiles'
// worker threads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/format/atom_index.h"
#include "core/plan/executor.h"
#include "core/util/status.h"

namespace ucp {

// The files of `index` that planning and executing `plan` read: those its outputs take bytes
// from, and the carried files whose objects the adapter planned from. Sorted, unique.
std::vector<uint32_t> FilesRead(const AtomIndex& index, const OutputPlan& plan);

// Where file `file` of `index` (under `tag_dir`, known to differ from the index) is damaged:
//   "record archive/data/3 fails its CRC-32 (it holds exp_avg of 1.fc1.weight)",
//   "record archive/data.pkl fails its CRC-32 (the pickle)", or
//   "its zip structure: <the reader's error>" (headers, directory, truncation).
// Several damaged records are joined with "; ". "" when the file is not a torch archive whose
// records all pass (e.g. a safetensors file of the atoms store, or damage only in bytes no
// checksum covers).
// Only records with data in [begin, end) are looked at.
std::string LocateDamage(const AtomIndex& index, uint32_t file, const std::string& tag_dir,
                         uint64_t begin = 0, uint64_t end = UINT64_MAX);

// ExecuteOptions::locate_damage for sources of `index` under `tag_dir`: LocateDamage within the
// failing chunk, else the atoms it holds. `index` must outlive the locator.
DamageLocator LocateDamageWith(const AtomIndex& index, const std::string& tag_dir);

// Hashes the files `files` of `index` under `tag_dir` (never trusting a journal) and compares
// them with the index. The first that differs is kCorrupt:
//   "<who>: source /ck/global_step5/x.pt has XXH3 ..., the index says ...: record ... fails its
//    CRC-32 (it holds fp32 of wte.weight)".
// A file that cannot be read is its own error (kNotFound when missing, kInvalidArgument when its
// name leaves the tag).
Status VerifySources(const AtomIndex& index, const std::vector<uint32_t>& files,
                     const std::string& tag_dir, std::string_view who);

// What must be checked before `plan` is executed, for the executor checks only chunks of files
// with chunk hashes as it reads them: the files the plan reads that have none, whole
// (VerifySources), and, of the carried archives that have them, the chunks holding what planning
// read (their pickles and zip directories). kCorrupt as VerifySources, or naming the byte range
// of a failing chunk and what it holds.
Status CheckSourcesBeforeReading(const AtomIndex& index, const OutputPlan& plan,
                                 const std::string& tag_dir, std::string_view who);

}  // namespace ucp
