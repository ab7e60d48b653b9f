#!/usr/bin/env bash
# Save-path overhead: wall time of torch.save of 1 GiB to a tracked DeepSpeed name, without and
# with LD_PRELOAD=libucp.so (which hashes the bytes with XXH3 as they are written and journals
# the file at close), measured two ways:
#   1. processes without and with the preload, in alternating rounds so drift hits both: the
#      medians and their ratio;
#   2. one process under the preload saving alternately to the tracked name and to a name ucp
#      passes through (bench_save.py --paired): the median of the per-pair ratios, which leaves
#      out the spread between processes.
# BUILD_DIR (set by tests/bench/run.sh) holds libucp.so; SAVE_BENCH_DIR picks the file system
# (default: a temporary directory under /tmp); ROUNDS and REPS size part 1, PAIRS part 2.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${UCP_PYTHON:-/usr/bin/python3}
lib=${BUILD_DIR:?BUILD_DIR must hold libucp.so}/libucp.so
rounds=${ROUNDS:-3}
reps=${REPS:-5}
pairs=${PAIRS:-30}
work=$(mktemp -d "${SAVE_BENCH_DIR:-/tmp}/ucp_bench_save.XXXXXX")
trap 'rm -rf "$work"' EXIT

: >"$work/plain.txt"
: >"$work/ucp.txt"
for ((round = 0; round < rounds; ++round)); do
  "$python" "$here/bench_save.py" "$work/plain" "$reps" >>"$work/plain.txt"
  LD_PRELOAD=$lib "$python" "$here/bench_save.py" "$work/ucp" "$reps" >>"$work/ucp.txt"
done
# The tracked runs must really have been tracked.
grep -q '"path":"mp_rank_00_model_states.pt"' "$work"/ucp/global_step1/.ucp/journal.*.jsonl

# median FILE FIELD: the median of column FIELD.
median() { awk -v f="$2" '{print $f}' "$1" | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
n=$(wc -l <"$work/plain.txt")
printf '%-36s %10s %10s %10s\n' "torch.save 1 GiB (median of $n)" "wall s" "GiB/s" "CPU s"
for run in plain ucp; do
  wall=$(median "$work/$run.txt" 2)
  cpu=$(median "$work/$run.txt" 4)
  label="without ucp"
  [[ $run == ucp ]] && label="with LD_PRELOAD=libucp.so"
  printf '%-36s %10.4f %10.2f %10.4f\n' "$label" "$wall" "$(awk -v s="$wall" 'BEGIN {print 1 / s}')" "$cpu"
  declare "${run}_wall=$wall" "${run}_cpu=$cpu"
done
printf '%-36s %10.3f %10s %10.3f\n' "ratio (with / without)" \
  "$(awk -v a="$ucp_wall" -v b="$plain_wall" 'BEGIN {print a / b}')" "" \
  "$(awk -v a="$ucp_cpu" -v b="$plain_cpu" 'BEGIN {print a / b}')"

LD_PRELOAD=$lib "$python" "$here/bench_save.py" "$work/paired" "$pairs" --paired >"$work/paired.txt"
# The tracked name was journaled; the other name was not.
grep -q '"path":"mp_rank_00_model_states.pt"' "$work"/paired/global_step1/.ucp/journal.*.jsonl
! grep -q bench_untracked "$work"/paired/global_step1/.ucp/journal.*.jsonl
awk '{print $2 / $6, $4 / $8}' "$work/paired.txt" >"$work/paired_ratio.txt"
printf '\n%-36s %10s %10s %10s\n' "one process, $pairs pairs (median)" "wall s" "" "CPU s"
printf '%-36s %10.4f %10s %10.4f\n' "untracked name (passed through)" "$(median "$work/paired.txt" 6)" "" \
  "$(median "$work/paired.txt" 8)"
printf '%-36s %10.4f %10s %10.4f\n' "tracked name" "$(median "$work/paired.txt" 2)" "" \
  "$(median "$work/paired.txt" 4)"
printf '%-36s %10.3f %10s %10.3f\n' "per-pair ratio (tracked / untracked)" \
  "$(median "$work/paired_ratio.txt" 1)" "" "$(median "$work/paired_ratio.txt" 2)"
