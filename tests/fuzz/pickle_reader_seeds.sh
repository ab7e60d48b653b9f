#!/usr/bin/env bash
# Seeds the pickle_reader fuzz corpus: the data.pkl of a few DeepSpeed fixture checkpoints
# (unzip -p) and the Python-generated pickle test cases (every protocol, hand-assembled ones).
# Usage: pickle_reader_seeds.sh CORPUS_DIR   (UCP_SHARED_DIR defaults to ../shared beside the repo)
set -euo pipefail
corpus=$1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
shared=${UCP_SHARED_DIR:-$repo/../shared}
mkdir -p "$corpus"
n=0
while IFS= read -r pt; do
  unzip -p "$pt" '*/data.pkl' >"$corpus/fixture_$n.pkl"
  n=$((n + 1))
done < <(find "$shared/fixtures/deepspeed" -path '*/dp2/global_step5/*.pt' 2>/dev/null | sort | head -6)
cases=$(mktemp -d)
trap 'rm -rf "$cases"' EXIT
/usr/bin/python3 "$repo/tests/fixtures/pickle/make_cases.py" "$cases"
for f in "$cases"/*.pkl; do
  cp "$f" "$corpus/case_$(basename "$f")"
done
