// `ucp export TAGDIR --format F --out DIR`: the tag's state in another layout.
//   safetensors          consolidated tensors of one state (--state), HF naming: one
//                        model.safetensors, or model-0000K-of-0000N.safetensors and
//                        model.safetensors.index.json when --max-shard-size splits them
//   deepspeed-universal  ds_to_universal's --output_folder layout, and latest_universal (the
//                        folder's name) beside DIR, which DeepSpeed's universal load reads
// With --job, one process of many under a launcher (job_part.h).
#include <cstdlib>
#include <iostream>
#include <memory>

#include "core/cli/commands.h"
#include "core/cli/job_part.h"
#include "core/cli/staging.h"
#include "core/cli/tag.h"
#include "core/cli/terminal.h"
#include "core/io/file.h"
#include "core/plan/executor.h"
#include "core/plan/export_plan.h"

namespace ucp::cli {
namespace {

struct ExportOptions {
  std::string tag_dir;
  std::string format;
  std::string out;
  std::string state = "fp32";
  bool state_given = false;
  uint64_t max_shard_bytes = 0;
  bool max_shard_given = false;
  unsigned threads = 0;
  bool force = false;
  JobOptions job;
};

constexpr std::string_view kCommand = "export";

int RunExport(const ExportOptions& options) {
  const bool universal = options.format == "deepspeed-universal";
  if (!universal && options.format != "safetensors") {
    return PrintError(kCommand,
                      Status::InvalidArgument("--format " + options.format +
                                              ": expected safetensors or deepspeed-universal"),
                      kExitUsage);
  }
  if (universal && (options.state_given || options.max_shard_given)) {
    return PrintError(kCommand,
                      Status::InvalidArgument("--state and --max-shard-size are for --format "
                                              "safetensors; deepspeed-universal holds every state"),
                      kExitUsage);
  }
  if (options.max_shard_given && options.max_shard_bytes == 0) {
    return PrintError(kCommand, Status::InvalidArgument("--max-shard-size must be at least 1"),
                      kExitUsage);
  }
  std::optional<JobPart> part;
  if (options.job.enabled) {
    Result<JobPart> from_env = JobPartFromEnv(&::getenv);
    if (!from_env.ok()) return PrintError(kCommand, from_env.status(), kExitUsage);
    part = std::move(*from_env);
  }
  const std::string out = TrimTrailingSlashes(options.out);
  if (Status free = CheckOutputFree(out, options.force); !free.ok()) {
    return PrintError(kCommand, free, kExitUsage);
  }
  IndexOptions index_options;
  index_options.threads = options.threads;
  Result<Tag> tag = OpenTag(options.tag_dir, index_options, /*use_saved_index=*/true);
  if (!tag.ok()) return PrintError(kCommand, tag.status(), kExitInput);
  Result<OutputPlan> plan =
      universal ? tag->adapter->PlanUniversalExport(tag->index, tag->dir)
                : PlanSafetensorsExport(tag->index, options.state, options.max_shard_bytes);
  if (!plan.ok()) return PrintError(kCommand, plan.status(), kExitInput);
  const size_t files =
      plan->archives.size() + plan->copies.size() + plan->safetensors.size() + plan->texts.size();
  const uint64_t data_bytes = plan->DataBytes();
  const std::string what = options.format + (universal ? "" : " " + options.state);
  const auto [parent, name] = SplitPath(out);

  if (part) {
    Result<JobPartResult> done = ExecuteJobPart(std::move(*plan), tag->index, tag->dir, out, *part,
                                                options.threads, options.force, options.job);
    Status status = done.status();
    if (status.ok() && done->committed && universal) {
      status = WriteFileAtomically(parent + "/latest_universal", name);
    }
    if (!status.ok()) return PrintError(kCommand, status, kExitInput);
    PrintJobPart(std::cout, out, what, *part, *done, files, data_bytes);
    return kExitOk;
  }
  Status status =
      ExecuteStaged(*plan, tag->index, tag->dir, out, options.threads, options.force, kCommand);
  if (status.ok() && universal) status = WriteFileAtomically(parent + "/latest_universal", name);
  if (!status.ok()) return PrintError(kCommand, status, kExitInput);
  std::cout << out << ": " << what << ", " << files << " files, " << HumanBytes(data_bytes)
            << " of tensor data\n";
  return kExitOk;
}

}  // namespace

void AddExportCommand(CLI::App& app, Run* run) {
  auto options = std::make_shared<ExportOptions>();
  CLI::App* command = app.add_subcommand(
      "export", "Write the tag's state as safetensors or as a DeepSpeed universal checkpoint");
  command->add_option("tagdir", options->tag_dir, "the tag directory, e.g. ckpt/global_step5")
      ->required();
  command->add_option("--format", options->format, "safetensors | deepspeed-universal")->required();
  command->add_option("--out", options->out, "the output directory (must not exist)")->required();
  command->add_option("--state", options->state,
                      "safetensors: which state of every parameter (fp32, bit16, exp_avg, ...)");
  command->add_option("--max-shard-size", options->max_shard_bytes,
                      "safetensors: bytes of tensor data per file (default: one file)");
  command->add_option("--threads", options->threads, "I/O threads (0: up to 8)");
  command->add_flag("--force", options->force, "replace an existing DIR");
  AddJobOptions(*command, options->job);
  command->callback([options, command, run] {
    options->state_given = command->count("--state") > 0;
    options->max_shard_given = command->count("--max-shard-size") > 0;
    *run = [options] { return RunExport(*options); };
  });
}

}  // namespace ucp::cli
