// The parallel degrees a trainer states on its own command line, as evidence of the current
// topology (DESIGN.md §5) where no NCCL communicator can tell tp or pp apart.
//
// Read from the process's arguments:
//   --tensor-model-parallel-size N, --pipeline-model-parallel-size N (Megatron-LM's and
//     Megatron-DeepSpeed's flags; "--flag N" or "--flag=N"; the last one given counts, as with
//     argparse); the expert-parallel size from --expert-model-parallel-size N (Megatron-LM's) or
//     --ep-world-size N (DeepSpeed's MoE examples and Megatron-DeepSpeed's);
//   the DeepSpeed config file it names, --deepspeed_config PATH (DeepSpeed's own argument) or
//     --deepspeed PATH (the Hugging Face Trainer's), a path ending in ".json": its
//     tensor_parallel.autotp_size (DeepSpeed's AutoTP training) gives tp, and
//     expert_parallel.autoep_size (its AutoEP training, where the section is "enabled": true)
//     ep.
// A flag whose value is not a positive integer, a config file that cannot be read or parsed, or
// two sources that give tp (or ep) differently is kFailedPrecondition naming them: the caller
// passes the tag through rather than guess.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/util/status.h"

namespace ucp::hooks {

struct TrainerDegrees {
  std::optional<uint32_t> tp;
  std::optional<uint32_t> pp;
  std::optional<uint32_t> ep;
  std::string tp_evidence;  // e.g. "--tensor-model-parallel-size 2", "ds.json tensor_parallel..."
  std::string pp_evidence;
  std::string ep_evidence;
};

// Reads a (small) file whole; a failure names the file.
using ReadFileFunction = std::function<Result<std::string>(const std::string& path)>;

[[nodiscard]] Result<TrainerDegrees> DegreesFromArguments(const std::vector<std::string>& arguments,
                                                          const ReadFileFunction& read_file);

// This process's arguments, from /proc/self/cmdline (whose size stat does not tell), at most
// `limit` bytes of it; empty when it cannot be read.
std::vector<std::string> ProcessArguments(uint64_t limit);

// The NUL-separated arguments of a /proc/<pid>/cmdline text, split.
std::vector<std::string> SplitCommandLine(const std::string& cmdline);

}  // namespace ucp::hooks
