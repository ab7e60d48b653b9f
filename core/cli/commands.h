// Subcommands of the `ucp` tool. Each Add*Command registers its subcommand on the app and
// stores, in *run, the function main calls when that subcommand was chosen; the function
// returns the process exit status:
//   0  success
//   1  an input could not be read, is malformed, or is outside what ucp supports; or an output
//      could not be written (nothing half-written is left behind)
//   2  usage: unknown command or option, a malformed argument (`--to dp=3,world=4`), an output
//      that exists without --force
//   3  `ucp verify` found files that differ from the index or are missing
// Errors are one line on stderr, `ucp <command>: <message>`.
//
// Thread-safety: called once from main, single-threaded.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace ucp::cli {

using Run = std::function<int()>;

inline constexpr int kExitOk = 0;
inline constexpr int kExitInput = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitMismatch = 3;

// `ucp inspect FILE [--json] [--tensor PATH [--count N]]`: the object tree of a torch.save
// archive or the tensors of a safetensors file, without reading tensor data.
// `ucp inspect TAGDIR [--json]`: a checkpoint tag as atoms (inspect_tag.cc).
void AddInspectCommand(CLI::App& app, Run* run);

// `ucp index TAGDIR [--threads N] [--no-journal]`: builds the tag's atom index and writes it to
// TAGDIR/.ucp/index.json atomically.
void AddIndexCommand(CLI::App& app, Run* run);

// `ucp reshard TAGDIR --to dp=N[,tp=..,pp=..,world=..] --out SAVEDIR [--threads N] [--force]`:
// writes SAVEDIR/<tag>/ for the target topology, then SAVEDIR/latest.
void AddReshardCommand(CLI::App& app, Run* run);

// `ucp export TAGDIR --format safetensors|deepspeed-universal --out DIR [--state S]
// [--max-shard-size BYTES] [--threads N] [--force]`.
void AddExportCommand(CLI::App& app, Run* run);

// `ucp verify TAGDIR [--threads N]`: re-hashes every file the tag's index lists.
void AddVerifyCommand(CLI::App& app, Run* run);

}  // namespace ucp::cli
