// Fuzzes the atom index reader: the input is an index document. Whatever Parse accepts must
// survive a round trip unchanged (ToJson of the re-parsed index is byte-identical), and an index
// with an atoms store must give a valid index over it.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/format/atom_index.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  ucp::Result<ucp::AtomIndex> index = ucp::AtomIndex::Parse(text, "fuzz");
  if (!index.ok()) return 0;
  const std::string json = index->ToJson();
  ucp::Result<ucp::AtomIndex> again = ucp::AtomIndex::Parse(json, "fuzz-again");
  if (!again.ok() || again->ToJson() != json) __builtin_trap();
  for (const ucp::Atom& atom : index->atoms()) {
    if (index->Find(atom.param, atom.state) != &atom) __builtin_trap();
  }
  if (index->contents().store && !index->OverStore().ok()) __builtin_trap();
  return 0;
}
