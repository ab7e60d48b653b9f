#include "core/cli/inspect_tag.h"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/cli/commands.h"
#include "core/cli/tag.h"
#include "core/cli/terminal.h"
#include "core/cli/topology_spec.h"
#include "core/tag/atoms_store.h"

namespace ucp::cli {
namespace {

using Json = nlohmann::ordered_json;

struct StateTotals {
  uint64_t atoms = 0;
  uint64_t bytes = 0;
};

uint64_t AtomBytes(const Atom& atom) {
  // A validated index's atoms fit their files, so numel × itemsize cannot overflow.
  const Result<uint64_t> numel = NumElements(atom.shape);
  return numel.ok() ? *numel * ItemSize(atom.dtype) : 0;
}

std::string ShapeText(const Shape& shape) { return Json(shape).dump(); }

}  // namespace

int InspectTag(const std::string& dir, bool json) {
  Result<Tag> tag = OpenTag(dir, IndexOptions{}, /*use_saved_index=*/true);
  if (!tag.ok()) return PrintError("inspect", tag.status(), kExitInput);
  const AtomIndexContents& contents = tag->index.contents();
  // Over an atoms store, the framework files the index still lists are gone: count the store's.
  const std::string store_prefix = std::string(kStoreDirectory) + "/";
  uint64_t file_count = 0;
  uint64_t file_bytes = 0;
  for (const IndexedFile& file : contents.files) {
    if (tag->from_store && !file.path.starts_with(store_prefix)) continue;
    ++file_count;
    file_bytes += file.size;
  }
  std::map<std::string, StateTotals> states;
  for (const Atom& atom : contents.atoms) {
    StateTotals& totals = states[atom.state];
    ++totals.atoms;
    totals.bytes += AtomBytes(atom);
  }

  if (json) {
    const Topology& t = contents.topology;
    Json groups = Json::array();
    for (const ParamGroup& group : contents.groups) {
      groups.push_back({{"params", group.params},
                        {"hyperparameters", group.hyperparameters},
                        {"scalars", group.scalars}});
    }
    Json state_json = Json::object();
    for (const auto& [state, totals] : states) {
      state_json[state] = {{"atoms", totals.atoms}, {"bytes", totals.bytes}};
    }
    Json atoms = Json::array();
    for (const Atom& atom : contents.atoms) {
      atoms.push_back({{"param", atom.param},
                       {"state", atom.state},
                       {"dtype", std::string(TorchName(atom.dtype))},
                       {"shape", atom.shape},
                       {"fragments", atom.fragments.size()},
                       {"bytes", AtomBytes(atom)}});
    }
    const Json out{
        {"tag_dir", tag->dir},
        {"tag", tag->name},
        {"index", tag->saved_index ? "saved" : "built"},
        {"sources", tag->from_store ? "atoms store" : "framework files"},
        {"framework", {{"name", contents.framework}, {"version", contents.framework_version}}},
        {"adapter", {{"name", contents.adapter}, {"schema", contents.adapter_schema}}},
        {"topology",
         {{"dp", t.dp},
          {"tp", t.tp},
          {"pp", t.pp},
          {"world", t.world},
          {"zero_stage", t.zero_stage}}},
        {"files", {{"count", file_count}, {"bytes", file_bytes}}},
        {"groups", std::move(groups)},
        {"states", std::move(state_json)},
        {"atoms", std::move(atoms)}};
    std::cout << out.dump(-1, ' ', false, Json::error_handler_t::replace) << "\n";
    return kExitOk;
  }

  std::cout << tag->dir << ": " << contents.framework << " " << contents.framework_version
            << " (adapter " << contents.adapter << " schema " << contents.adapter_schema << "), "
            << TopologyText(contents.topology) << "\n";
  std::cout << "files: " << file_count << ", " << HumanBytes(file_bytes) << " (index "
            << (tag->saved_index ? "saved in the tag" : "built now")
            << (tag->from_store ? "; the framework's files are gone, read from its atoms store"
                                : "")
            << ")\n";
  for (size_t g = 0; g < contents.groups.size(); ++g) {
    const ParamGroup& group = contents.groups[g];
    std::cout << "group " << g << ": " << group.params.size() << " params, "
              << group.hyperparameters.dump() << ", " << group.scalars.dump() << "\n";
  }
  for (const auto& [state, totals] : states) {
    std::cout << "state " << state << ": " << totals.atoms << " atoms, " << HumanBytes(totals.bytes)
              << "\n";
  }
  size_t param_width = 5;
  size_t state_width = 5;
  for (const Atom& atom : contents.atoms) {
    param_width = std::max(param_width, atom.param.size());
    state_width = std::max(state_width, atom.state.size());
  }
  std::printf("%-*s  %-*s  %-9s  %-16s  %s\n", static_cast<int>(param_width), "param",
              static_cast<int>(state_width), "state", "dtype", "shape", "fragments");
  for (const Atom& atom : contents.atoms) {
    std::printf("%-*s  %-*s  %-9s  %-16s  %zu\n", static_cast<int>(param_width), atom.param.c_str(),
                static_cast<int>(state_width), atom.state.c_str(),
                std::string(TorchName(atom.dtype)).c_str(), ShapeText(atom.shape).c_str(),
                atom.fragments.size());
  }
  std::fflush(stdout);
  return kExitOk;
}

}  // namespace ucp::cli
