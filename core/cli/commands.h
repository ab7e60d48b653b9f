// Subcommands of the `ucp` tool. Each Add*Command registers its subcommand on the app and
// stores, in *run, the function main calls when that subcommand was chosen; the function
// returns the process exit status (0 success, 1 a file could not be read or is malformed).
//
// Thread-safety: called once from main, single-threaded.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace ucp::cli {

using Run = std::function<int()>;

// `ucp inspect FILE [--json] [--tensor PATH [--count N]]`: the object tree of a torch.save
// archive or the tensors of a safetensors file, without reading tensor data.
void AddInspectCommand(CLI::App& app, Run* run);

}  // namespace ucp::cli
