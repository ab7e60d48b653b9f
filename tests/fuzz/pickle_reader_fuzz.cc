// libFuzzer target for the unpickler, with the pickler and Render on whatever it accepts.
//
// Checked properties: reading never crashes or leaks; what the pickler writes, the unpickler
// reads back; a second read → write round trip reproduces the first pickle exactly (the
// protocol 2 form is a fixed point); and a copy made by Graph::Import writes the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/format/pickle_reader.h"
#include "core/format/pickle_writer.h"

namespace {

void Check(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ucp::pickle;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  auto graph = ReadPickle(input);
  if (!graph.ok()) return 0;
  (void)Render(graph->root());
  auto written = WritePickle(graph->root());
  if (!written.ok()) return 0;
  Graph copy;
  auto copied = WritePickle(copy.Import(graph->root()));
  Check(copied.ok() && *copied == *written);
  auto reread = ReadPickle(*written);
  Check(reread.ok());
  auto rewritten = WritePickle(reread->root());
  Check(rewritten.ok());
  Check(*rewritten == *written);
  return 0;
}
