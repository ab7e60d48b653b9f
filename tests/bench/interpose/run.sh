#!/usr/bin/env bash
# Added nanoseconds per call of libucp.so's wrappers on untracked files. Runs interpose_bench
# plain and under LD_PRELOAD=libucp.so, alternating, ROUNDS times each (default 3), each
# benchmark repeated 5 times; keeps the fastest repetition (noise only ever adds time). Prints
# per call: plain, under ucp, and the added time two ways:
#   "vs plain":  under ucp - plain run (across processes)
#   "in-process": under ucp, hooked call - direct call into glibc (same process, same moment)
# Then runs wrapper_bench (the wrappers in-process over stub "real" functions: no system call)
# and prints each wrapper's own cost, in CPU time (the figure that does not depend on how many
# other processes share the machine).
# Expects BUILD_DIR (tests/bench/run.sh sets it).
set -euo pipefail
bench=$BUILD_DIR/tests/bench/interpose/interpose_bench
lib=$BUILD_DIR/libucp.so
rounds=${ROUNDS:-3}
out=$(mktemp -d /tmp/ucp_bench_out.XXXXXX)
trap 'rm -rf "$out"' EXIT
args=(--benchmark_repetitions=5 --benchmark_format=json --benchmark_min_time=0.1)
for round in $(seq "$rounds"); do
  "$bench" "${args[@]}" >"$out/plain.$round.json"
  LD_PRELOAD=$lib "$bench" "${args[@]}" >"$out/ucp.$round.json"
done
python3 - "$out" "$rounds" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def fastest(kind):
    best = {}
    for r in range(1, rounds + 1):
        with open(f"{out}/{kind}.{r}.json") as f:
            for b in json.load(f)["benchmarks"]:
                if b.get("run_type") == "iteration":
                    name = b["run_name"]
                    best[name] = min(best.get(name, float("inf")), b["real_time"])
    return best
plain, ucp = fastest("plain"), fastest("ucp")
print(f"{'call':<18}{'plain ns':>10}{'ucp ns':>10}{'vs plain':>10}{'in-process':>12}")
for name in plain:
    if not name.endswith("/hooked"):
        continue
    call = name[: -len("/hooked")]
    direct = ucp[call + "/direct"]
    print(f"{call:<18}{plain[name]:>10.1f}{ucp[name]:>10.1f}{ucp[name] - plain[name]:>10.1f}"
          f"{ucp[name] - direct:>12.1f}")
PY

"$BUILD_DIR/tests/bench/interpose/wrapper_bench" --benchmark_repetitions=5 \
  --benchmark_format=json >"$out/wrapper.json"
python3 - "$out/wrapper.json" <<'PY'
import json, sys
with open(sys.argv[1]) as f:
    runs = json.load(f)["benchmarks"]
best = {}
for b in runs:
    if b.get("run_type") == "iteration":
        best[b["run_name"]] = min(best.get(b["run_name"], float("inf")), b["cpu_time"])
print()
print(f"{'wrapper (no syscall)':<22}{'stub ns':>9}{'wrapped ns':>12}{'added ns':>10}  (CPU time)")
for name in best:
    if name.endswith("_Wrapped"):
        call = name[len("BM_"): -len("_Wrapped")]
        stub = best[f"BM_{call}_Stub"]
        print(f"{call:<22}{stub:>9.1f}{best[name]:>12.1f}{best[name] - stub:>10.1f}")
PY

if command -v valgrind >/dev/null; then
  echo
  bash "$(dirname "${BASH_SOURCE[0]}")/instructions.sh"
fi
