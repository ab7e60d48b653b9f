#!/usr/bin/env bash
# Seeds the torch archive fuzz corpus (CORPUS_DIR, $1) with the generated torch.save fixtures
# and a few small DeepSpeed files from ../shared/fixtures when present.
set -euo pipefail
corpus=$1
source_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$corpus"
/usr/bin/python3 "$source_dir/tests/fixtures/make_torch_files.py" "$corpus"
shared=${UCP_SHARED_DIR:-$source_dir/../shared}
if [[ -d $shared/fixtures/deepspeed ]]; then
  # Process substitution, not a pipe into head: a SIGPIPE'd find would fail under pipefail.
  mapfile -t small < <(find "$shared/fixtures/deepspeed" -name '*.pt' -size -64k | sort)
  for file in "${small[@]:0:20}"; do
    cp "$file" "$corpus/ds_$(echo "$file" | md5sum | cut -c1-12)"
  done
fi
