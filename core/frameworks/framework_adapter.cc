#include "core/frameworks/framework_adapter.h"

#include "core/frameworks/deepspeed/moe.h"
#include "core/frameworks/deepspeed/tp.h"
#include "core/frameworks/deepspeed/zero.h"
#include "core/frameworks/deepspeed/zero3.h"

namespace ucp {

const std::vector<const FrameworkAdapter*>& Adapters() {
  static const DeepSpeedMoeAdapter* const kDeepSpeedMoe = new DeepSpeedMoeAdapter();
  static const DeepSpeedZero3Adapter* const kDeepSpeedZero3 = new DeepSpeedZero3Adapter();
  static const DeepSpeedTpAdapter* const kDeepSpeedTp = new DeepSpeedTpAdapter();
  static const DeepSpeedZeroAdapter* const kDeepSpeedZero = new DeepSpeedZeroAdapter();
  static const std::vector<const FrameworkAdapter*>* const kAdapters =
      new std::vector<const FrameworkAdapter*>{kDeepSpeedMoe, kDeepSpeedZero3, kDeepSpeedTp,
                                               kDeepSpeedZero};
  return *kAdapters;
}

Result<const FrameworkAdapter*> FindAdapter(std::string_view name) {
  if (name == "deepspeed-pipe") {
    return Status::NotFound(
        "framework adapter \"deepspeed-pipe\": an index written by an earlier ucp; its pipeline "
        "tags are deepspeed-tp's now: rebuild the index with `ucp index <tag>`");
  }
  std::string known;
  for (const FrameworkAdapter* adapter : Adapters()) {
    if (adapter->name() == name) return adapter;
    known += (known.empty() ? "" : ", ") + std::string(adapter->name());
  }
  return Status::NotFound("framework adapter \"" + std::string(name) +
                          "\": unknown (known: " + known + ")");
}

Result<const FrameworkAdapter*> DetectAdapter(const std::string& tag_dir) {
  for (const FrameworkAdapter* adapter : Adapters()) {
    if (adapter->Recognizes(tag_dir)) return adapter;
  }
  return Status::NotFound("framework adapter: no adapter recognises the files in " + tag_dir);
}

}  // namespace ucp
