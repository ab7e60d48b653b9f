// The save journal: one line per checkpoint file closed by the trainer, kept inside the tag.
//
// Layout (normative; README "Save journal"):
//   <tag>/.ucp/                          directory, created 0755 when missing
//   <tag>/.ucp/journal.<host>.<pid>.jsonl one file per writing process; <host> is gethostname(),
//                                         so processes on different nodes sharing a file system
//                                         never append to the same file
// Each file is a sequence of records, each one line: a JSON object (UTF-8, no embedded newline)
// followed by "\n". Only the file's own process appends to it, under a process-wide lock, on an
// O_APPEND descriptor, retrying EINTR and short writes until the line is whole; an append that
// fails part-way (a full disk) truncates the file back to where its line began, so a torn line
// can only be the last, left by a crash. Members (all required; readers ignore unknown ones):
//   "v"          1, the record version
//   "path"       the file's path relative to <tag> (e.g. "mp_rank_00_model_states.pt",
//                "mp_rank_00/model_optim_rng.pt"; a commit signal outside the tag, such as
//                DeepSpeed's <save>/latest, is "../latest"); never absolute
//   "size"       the file's size in bytes when it was closed
//   "xxh3"       XXH3-64 (seed 0) of the file's bytes as 16 lowercase hex digits: the digits that
//                `xxhsum -H3` prints
//   "rank"       the launcher's global rank (RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID,
//                first one set), or -1
//   "pid"        the writing process
//   "time_ns"    wall-clock time of the close, nanoseconds since the Unix epoch
//   "framework"  the layout that recognised the file ("deepspeed", "megatron", "dcp")
//   "role"       "data" (a checkpoint file) or "commit" (the framework's commit signal)
// Optional members (readers that do not know them ignore them, as the rule above says):
//   "chunk_bytes", "chunks"
//                together: the file's chunk hashes (core/util/chunked_xxh3.h), XXH3-64 of each
//                chunk_bytes-long piece, the last one possibly shorter, as 16 lowercase hex
//                digits each, concatenated (ceil(size / chunk_bytes) of them)
//   "ino", "mtime_ns"
//                together: the file's inode number (st_ino) and modification time (st_mtim, in
//                nanoseconds since the Unix epoch) as stat(2) reported them just after the close.
//                With "size" they say which bytes on disk the record describes: a reader compares
//                them for equality with a stat of the file now, never with a clock (the device
//                number is left out: it differs from mount to mount of one file system)
//   "durable"    true: under UCP_DURABLE, the writing process fsynced the file and its
//                directories after the close that the record's other members describe; the
//                record repeats that close's record member for member (same "time_ns"), so a
//                reader that ignores "durable" sees the same close twice. Absent means false.
//   "job"        this run of the job (hooks' RunJob: the launcher's id, LauncherJob, else
//                "nccl=<hash>" of the NCCL world's unique id): every process of one run of a job
//                writes the same, a rerun of the job (requeued, restarted) another. Absent when
//                there is neither.
// A crash can leave the last line of a file without its "\n": readers skip such a torn last line
// with a warning. Any other malformed line makes the whole file unreadable (kCorrupt).
//
// Thread-safety: free functions; AppendJournalRecord may be called concurrently from any thread
// and process.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/frameworks/checkpoint_layout.h"
#include "core/io/file.h"
#include "core/util/chunked_xxh3.h"
#include "core/util/status.h"

namespace ucp {

// The identity and version of a file's bytes as stat(2) reports them on every node of a shared
// file system: with the size, equal stamps mean the same bytes (unless rewritten at the same size
// within the file system's timestamp granularity).
struct FileStamp {
  uint64_t ino = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileStamp&) const = default;
};

// A file's size and stamp as stat(2) reports them now.
struct FileOnDisk {
  uint64_t size = 0;
  FileStamp stamp;
  bool operator==(const FileOnDisk&) const = default;
};
FileOnDisk FileOnDiskOf(const struct stat& st);
// nullopt when `path` cannot be stat'ed (missing, for one).
std::optional<FileOnDisk> StatFileOnDisk(const std::string& path);

struct JournalRecord {
  std::string path;  // relative to the tag directory
  uint64_t size = 0;
  uint64_t xxh3 = 0;
  int64_t rank = -1;
  int64_t pid = 0;
  int64_t time_ns = 0;
  std::string framework;
  FileRole role = FileRole::kData;
  bool durable = false;                           // "durable": true; written only when true
  ChunkHashes chunks = {};                        // written only when recorded
  std::optional<FileStamp> stamp = std::nullopt;  // "ino" and "mtime_ns"; written when recorded
  std::string job;                                // "job"; written when not empty
  // Not a member: the writing process's host, from the name of the journal file the record was
  // read from (ReadJournal); empty otherwise.
  std::string host;
};

// "<tag_dir>/.ucp".
std::string JournalDirectory(std::string_view tag_dir);

// CLOCK_REALTIME in nanoseconds since the Unix epoch: the clock of a record's "time_ns".
int64_t WallClockNs();

// This host's name as journal file names spell it: gethostname(), '/' replaced by '_'
// ("unknown" when it has none).
std::string JournalHostName();

// 16 lowercase hex digits, as `xxhsum -H3` prints them.
std::string FormatXxh3(uint64_t hash);
// The hash FormatXxh3 printed; kCorrupt for anything else.
Result<uint64_t> ParseXxh3(std::string_view text);

// The launcher's global rank from the environment, or -1.
int64_t LauncherRank();

// What identifies this run of the job to every one of its processes, from the launchers'
// environment: each of Slurm's job, step and restart count (SLURM_JOB_ID, SLURM_STEP_ID,
// SLURM_RESTART_COUNT), PMIx's namespace (PMIX_NAMESPACE: Open MPI 5, srun --mpi=pmix) and
// torchelastic's run and restart count (TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT) that is
// set, joined: e.g. "slurm=812.0.0;torchelastic=none.1". Empty when none is set (ranks started
// by hand, DeepSpeed's pdsh launcher: hooks' RunJob names those by their NCCL world).
std::string LauncherJob();

// The record as one JSON line, "\n" included. InvalidArgument for an absolute or empty path, or
// text that is not valid UTF-8.
Result<std::string> EncodeJournalRecord(const JournalRecord& record);

// Appends `record` to this process's journal of `tag_dir` (creating `.ucp/` and the file),
// retrying EINTR and short writes: the line lands whole, or on a crash torn at the end of the
// file; a failed append (a full disk) truncates the file back to where the line began.
Status AppendJournalRecord(std::string_view tag_dir, const JournalRecord& record);

struct JournalContents {
  std::vector<JournalRecord> records;
  std::vector<std::string> warnings;  // e.g. a torn last line that was skipped
};

// Parses one journal file's bytes; `name` only labels messages. kCorrupt names the line.
Result<JournalContents> ParseJournal(std::string_view name, std::string_view bytes);

// A file's size, XXH3-64 and chunk hashes.
struct FileDigest {
  uint64_t size = 0;
  uint64_t xxh3 = 0;
  ChunkHashes chunks = {};
};

// Reads `file` from its start to its end and hashes it.
Result<FileDigest> HashFile(const File& file);
// Opens `path` and hashes it.
Result<FileDigest> HashFile(const std::string& path);

// The close of each path among `records` that describes the file on disk now: the data record
// (not a durable repeat: those repeat a close) whose size and stamp equal what `on_disk(path)`
// reports. No clock is compared, so records written by the clocks of other nodes match as well as
// this one's. A path matched by closes of different bytes (rewritten at one size within one
// timestamp tick, or written by two processes at once) matches none: it cannot be told which of
// them the disk holds. With `keep_ambiguous` such a path keeps its first matching close: it is
// closed, and what it holds must be read from disk (MatchSave, whose index build hashes files so).
// Records without a stamp match nothing. One pass: O(records), `on_disk` asked once per path.
using FileOnDiskLookup = std::function<std::optional<FileOnDisk>(const std::string& path)>;
std::unordered_map<std::string, const JournalRecord*> ClosesOnDisk(
    const std::vector<JournalRecord>& records, const FileOnDiskLookup& on_disk,
    bool keep_ambiguous = false);
// The lookup for the files of `tag_dir`: a stat of "<tag_dir>/<path>".
FileOnDiskLookup TagFilesOnDisk(const std::string& tag_dir);

// Reads and parses one journal file; a file named "journal.<host>.<pid>.jsonl" gives its records
// that host.
Result<JournalContents> ReadJournal(const std::string& path);

// Reads every journal.*.jsonl under `<tag_dir>/.ucp/`, in file-name order. NotFound when the
// directory does not exist.
Result<JournalContents> ReadTagJournals(std::string_view tag_dir);

}  // namespace ucp
