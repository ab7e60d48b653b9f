// `ucp reshard TAGDIR --to dp=N --out SAVEDIR`: the tag's state as the files its framework
// writes at another topology, in SAVEDIR/<tag>/, then SAVEDIR/latest. With --job, one process of
// many under a launcher (job_part.h).
#include <cstdlib>
#include <iostream>
#include <memory>

#include "core/cli/commands.h"
#include "core/cli/job_part.h"
#include "core/cli/staging.h"
#include "core/cli/tag.h"
#include "core/cli/terminal.h"
#include "core/cli/topology_spec.h"
#include "core/io/file.h"
#include "core/plan/executor.h"

namespace ucp::cli {
namespace {

struct ReshardOptions {
  std::string tag_dir;
  std::string to;
  std::string out;
  unsigned threads = 0;
  bool force = false;
  JobOptions job;
};

int RunReshard(const ReshardOptions& options) {
  constexpr std::string_view kCommand = "reshard";
  Result<TopologySpec> spec = ParseTopologySpec(options.to);
  if (!spec.ok()) return PrintError(kCommand, spec.status(), kExitUsage);
  std::optional<JobPart> part;
  if (options.job.enabled) {
    Result<JobPart> from_env = JobPartFromEnv(&::getenv);
    if (!from_env.ok()) return PrintError(kCommand, from_env.status(), kExitUsage);
    part = std::move(*from_env);
  }
  IndexOptions index_options;
  index_options.threads = options.threads;
  Result<Tag> tag = OpenTag(options.tag_dir, index_options, /*use_saved_index=*/true);
  if (!tag.ok()) return PrintError(kCommand, tag.status(), kExitInput);
  const Topology& source = tag->index.contents().topology;
  Result<Topology> target = ResolveTopology(*spec, source);
  if (!target.ok()) return PrintError(kCommand, target.status(), kExitUsage);
  const std::string save_dir = TrimTrailingSlashes(options.out);
  const std::string final_path = save_dir + "/" + tag->name;
  if (Status free = CheckOutputFree(final_path, options.force); !free.ok()) {
    return PrintError(kCommand, free, kExitUsage);
  }
  Result<OutputPlan> plan = tag->adapter->PlanReshard(tag->index, tag->dir, *target);
  if (!plan.ok()) return PrintError(kCommand, plan.status(), kExitInput);
  const size_t files = plan->archives.size() + plan->copies.size() + plan->safetensors.size();
  const uint64_t data_bytes = plan->DataBytes();
  const std::string what = TopologyText(source) + " -> " + TopologyText(*target);

  if (part) {
    Result<JobPartResult> done = ExecuteJobPart(std::move(*plan), tag->index, tag->dir, final_path,
                                                *part, options.threads, options.force, options.job);
    Status status = done.status();
    if (status.ok() && done->committed) {
      status = WriteFileAtomically(save_dir + "/latest", tag->name);
    }
    if (!status.ok()) return PrintError(kCommand, status, kExitInput);
    PrintJobPart(std::cout, final_path, what, *part, *done, files, data_bytes);
    return kExitOk;
  }
  Status status = ExecuteStaged(*plan, tag->index, tag->dir, final_path, options.threads,
                                options.force, kCommand);
  if (status.ok()) status = WriteFileAtomically(save_dir + "/latest", tag->name);
  if (!status.ok()) return PrintError(kCommand, status, kExitInput);
  std::cout << final_path << ": " << what << ", " << files << " files, " << HumanBytes(data_bytes)
            << " of tensor data\n";
  return kExitOk;
}

}  // namespace

void AddReshardCommand(CLI::App& app, Run* run) {
  auto options = std::make_shared<ReshardOptions>();
  CLI::App* command =
      app.add_subcommand("reshard", "Write the tag as its framework saves it at another topology");
  command->add_option("tagdir", options->tag_dir, "the tag directory, e.g. ckpt/global_step5")
      ->required();
  command
      ->add_option(
          "--to", options->to,
          "target topology: dp=N[,tp=N,pp=N,ep=N,world=N,partition=M] (ep: an MoE tag's "
          "expert-parallel size; M: uniform, parameters or type, the trainer's partition_method "
          "where a pipeline's placement at another pp is ambiguous)")
      ->required();
  command->add_option("--out", options->out, "save directory: gets <tag>/ and latest")->required();
  command->add_option("--threads", options->threads, "I/O threads (0: up to 8)");
  command->add_flag("--force", options->force, "replace an existing SAVEDIR/<tag>");
  AddJobOptions(*command, options->job);
  command->callback([options, run] { *run = [options] { return RunReshard(*options); }; });
}

}  // namespace ucp::cli
