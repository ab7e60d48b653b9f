#!/usr/bin/env bash
# A long libFuzzer run of one target, by hand (CI runs each target for UCP_FUZZ_SECONDS only).
# Usage: tests/fuzz/long_run.sh TARGET SECONDS   e.g. tests/fuzz/long_run.sh zip_reader_fuzz 420
# Needs the clang fuzz build in FUZZ_BUILD_DIR (default build-fuzz, as tests/run.sh makes it).
# Seeds a fresh corpus with tests/fuzz/<topic>_seeds.sh and tests/fuzz/regressions/TARGET/, runs
# at nice 19, and keeps what libFuzzer writes under FUZZ_BUILD_DIR/long/TARGET/: corpus/,
# artifacts/ (crash-*, timeout-*, oom-*: copy each into tests/fuzz/regressions/TARGET/ once
# fixed) and log. Prints libFuzzer's final lines and the corpus size.
set -euo pipefail
target=${1:?usage: long_run.sh TARGET SECONDS}
seconds=${2:?usage: long_run.sh TARGET SECONDS}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$(cd "${FUZZ_BUILD_DIR:-$repo/build-fuzz}" && pwd)
binary=$build/tests/fuzz/$target
[[ -x "$binary" ]] || { echo "long_run: no $binary (build the fuzz targets first)" >&2; exit 2; }
out=$build/long/$target
rm -rf "$out"
mkdir -p "$out/corpus" "$out/artifacts"
seeds=$repo/tests/fuzz/${target%_fuzz}_seeds.sh
[[ ! -f "$seeds" ]] || bash "$seeds" "$out/corpus" >/dev/null
regressions=$repo/tests/fuzz/regressions/$target
[[ ! -d "$regressions" ]] || cp "$regressions"/* "$out/corpus/"
echo "long_run: $target for ${seconds}s from $(ls "$out/corpus" | wc -l) seed(s)"
status=0
# -timeout: an input that takes over 2 min is a hang worth keeping (the run is niced, so a shorter
# bound catches starvation on a busy machine), as is one over 2 GiB.
nice -n 19 "$binary" -max_total_time="$seconds" -print_final_stats=1 -rss_limit_mb=2048 \
  -timeout=120 -artifact_prefix="$out/artifacts/" "$out/corpus" >"$out/log" 2>&1 || status=$?
grep -E '^#[0-9]+.*(DONE|pulse|NEW)' "$out/log" | tail -1
grep -E '^(stat::|Done|SUMMARY|==[0-9]+==ERROR|artifact_prefix|Test unit written)' "$out/log" || true
echo "corpus: $(ls "$out/corpus" | wc -l) files, $(du -sk "$out/corpus" | cut -f1) KiB"
echo "artifacts: $(ls "$out/artifacts" | wc -l)"
exit $status
