// ucp: offline tools over checkpoints (see README.md, "The ucp command").
#include <CLI/CLI.hpp>

#include "core/cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"ucp: universal checkpoints for torch and DeepSpeed"};
  app.require_subcommand(1);
  ucp::cli::Run run;
  ucp::cli::AddInspectCommand(app, &run);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    // Usage errors exit with 2, keeping 1 for files that cannot be read.
    const int code = app.exit(error);
    return code == 0 ? 0 : 2;
  }
  return run();
}
