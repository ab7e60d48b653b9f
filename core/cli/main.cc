// ucp: offline tools over checkpoints (see README.md, "The ucp command"; exit statuses in
// commands.h).
#include <CLI/CLI.hpp>
#include <iostream>

#include "core/cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"ucp: universal checkpoints for torch and DeepSpeed"};
  app.require_subcommand(1);
  ucp::cli::Run run;
  ucp::cli::AddInspectCommand(app, &run);
  ucp::cli::AddIndexCommand(app, &run);
  ucp::cli::AddReshardCommand(app, &run);
  ucp::cli::AddExportCommand(app, &run);
  ucp::cli::AddVerifyCommand(app, &run);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& help) {
    return app.exit(help);
  } catch (const CLI::CallForAllHelp& help) {
    return app.exit(help);
  } catch (const CLI::ParseError& error) {
    // One line, like every other error, naming the subcommand when parsing got that far.
    const std::vector<CLI::App*> chosen = app.get_subcommands();
    std::cerr << "ucp" << (chosen.empty() ? "" : " " + chosen.front()->get_name())
              << ": usage: " << error.what() << " (ucp "
              << (chosen.empty() ? "" : chosen.front()->get_name() + " ") << "--help)\n";
    return ucp::cli::kExitUsage;
  }
  return run();
}
