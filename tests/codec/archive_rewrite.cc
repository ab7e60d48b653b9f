// Test driver: archive_rewrite IN.pt OUT.pt reads IN with TorchArchiveReader and writes its
// object tree to OUT with TorchArchiveWriter, every storage streamed from IN's byte ranges.
// Exit status 0 on success, 1 with the error on stderr.
#include <iostream>

#include "core/format/torch_archive_reader.h"
#include "core/format/torch_archive_writer.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: archive_rewrite IN.pt OUT.pt\n";
    return 2;
  }
  ucp::Result<ucp::TorchArchiveReader> reader = ucp::TorchArchiveReader::Open(argv[1]);
  if (!reader.ok()) {
    std::cerr << reader.status().ToString() << "\n";
    return 1;
  }
  ucp::TorchArchiveWriter::Options options;
  options.sync = false;  // test output in a scratch folder
  ucp::Result<uint64_t> size = ucp::RewriteArchive(*reader, argv[2], options);
  if (!size.ok()) {
    std::cerr << size.status().ToString() << "\n";
    return 1;
  }
  return 0;
}
