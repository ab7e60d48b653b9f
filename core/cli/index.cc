// `ucp index TAGDIR`: builds the tag's atom index and saves it in the tag.
#include <iostream>
#include <memory>

#include "core/cli/commands.h"
#include "core/cli/tag.h"
#include "core/cli/terminal.h"
#include "core/cli/topology_spec.h"

namespace ucp::cli {
namespace {

struct IndexCommandOptions {
  std::string tag_dir;
  unsigned threads = 0;
  bool no_journal = false;
};

int RunIndex(const IndexCommandOptions& options) {
  IndexOptions index_options;
  index_options.threads = options.threads;
  index_options.trust_journal = !options.no_journal;
  Result<Tag> tag = OpenTag(options.tag_dir, index_options, /*use_saved_index=*/false);
  if (!tag.ok()) return PrintError("index", tag.status(), kExitInput);
  const std::string path = IndexPath(tag->dir);
  if (Status written = tag->index.Write(path); !written.ok()) {
    return PrintError("index", written, kExitInput);
  }
  const AtomIndexContents& contents = tag->index.contents();
  uint64_t bytes = 0;
  for (const IndexedFile& file : contents.files) bytes += file.size;
  std::cout << path << ": " << contents.framework << " " << contents.framework_version << ", "
            << TopologyText(contents.topology) << ", " << contents.files.size() << " files ("
            << HumanBytes(bytes) << "), atoms: " << contents.atoms.size()
            << ", parameter groups: " << contents.groups.size() << "\n";
  return kExitOk;
}

}  // namespace

void AddIndexCommand(CLI::App& app, Run* run) {
  auto options = std::make_shared<IndexCommandOptions>();
  CLI::App* command = app.add_subcommand(
      "index", "Describe a checkpoint tag as atoms and save that in TAGDIR/.ucp/index.json");
  command->add_option("tagdir", options->tag_dir, "the tag directory, e.g. ckpt/global_step5")
      ->required();
  command->add_option("--threads", options->threads, "hashing threads (0: up to 8)");
  command->add_flag("--no-journal", options->no_journal,
                    "hash every file, even those the save journals already hashed");
  command->callback([options, run] { *run = [options] { return RunIndex(*options); }; });
}

}  // namespace ucp::cli
