#!/usr/bin/env bash
# Seeds the zip_reader fuzz corpus: a few small torch.save files written by DeepSpeed, from
# $UCP_SHARED_DIR/fixtures/deepspeed (default ../shared beside the repository).
# Usage: zip_reader_seeds.sh CORPUS_DIR
set -euo pipefail
corpus=${1:?usage: zip_reader_seeds.sh CORPUS_DIR}
shared=${UCP_SHARED_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)/shared}
mkdir -p "$corpus"
n=0
# The smallest files first: the fuzzer mutates small inputs much faster.
while IFS= read -r file; do
  rm -f "$corpus/seed_$n.pt"
  cp "$file" "$corpus/seed_$n.pt"
  chmod u+w "$corpus/seed_$n.pt"
  n=$((n + 1))
done < <(find "$shared/fixtures/deepspeed" -name '*.pt' -size -200k -printf '%s %p\n' 2>/dev/null |
         sort -n | awk 'NR % 200 == 1 {print $2}' | head -n 8)
echo "zip_reader_seeds: $n seed files in $corpus"
