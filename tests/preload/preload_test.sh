#!/usr/bin/env bash
# Preload tests: runs host programs with and without libucp.so and compares what they print.
# Usage: preload_test.sh CASE. CTest sets, from tests/preload/CMakeLists.txt:
#   UCP_LIB        build/libucp.so
#   UCP_TEST_LIB   libucp_test_hooks.so (libucp.so's objects + test_hooks.cc)
#   UCP_EARLY_LIB  libucp_test_early.so (file I/O in its constructor)
#   HOSTS          the folder with the host programs
#   UCP_PYTHON     python3 with torch
#   EXPORTS_MAP    interpose/exports.map
#   PRELOAD_FIRST  what must precede ucp in LD_PRELOAD (the ASan runtime in ASan builds), or ""
#   BUILD_ROOT     the build folder (`cmake --install` of it)
set -euo pipefail

case_name=$1
work=$(mktemp -d /tmp/ucp_preload.XXXXXX)
trap 'rm -rf "$work"' EXIT

fail() {
  echo "FAIL ($case_name): $*" >&2
  exit 1
}

# run OUT_PREFIX PRELOAD CMD...: runs CMD with LD_PRELOAD=PRELOAD ("" = none), stdout to
# OUT_PREFIX.out, stderr to OUT_PREFIX.err; returns CMD's status.
run() {
  local out=$1 preload=$2
  shift 2
  local status=0
  if [[ -n "$preload" ]]; then
    # Only the host gets the preload, not timeout.
    timeout 300 env LD_PRELOAD="${PRELOAD_FIRST:+$PRELOAD_FIRST }$preload" "$@" \
      >"$out.out" 2>"$out.err" || status=$?
  else
    timeout 300 "$@" >"$out.out" 2>"$out.err" || status=$?
  fi
  return $status
}

# same_output A B: the two runs printed the same bytes on stdout.
same_output() {
  cmp -s "$1.out" "$2.out" || { diff "$1.out" "$2.out" | head -20 >&2; fail "stdout of $1 and $2 differ"; }
}

no_stderr() {
  [[ ! -s "$1.err" ]] || { head -5 "$1.err" >&2; fail "$1 printed on stderr"; }
}

# check_events EVENTS DIR: every file written under DIR that still exists was reported with all
# of its bytes (sum of sequential writes == size) and no position change.
check_events() {
  local events=$1 dir=$2 checked=0
  [[ -s "$events" ]] || fail "no events recorded"
  while read -r path; do
    [[ -e "$path" ]] || continue
    local seq nonseq size
    seq=$(grep "^close $path " "$events" | sed 's/.* seq=\([0-9]*\).*/\1/' | awk '{s += $1} END {print s}')
    nonseq=$(grep "^close $path " "$events" | grep -c "nonseq=1" || true)
    size=$(stat -c %s "$path")
    [[ "$nonseq" == 0 ]] || fail "$path: unexpected non-sequential write"
    [[ "$seq" == "$size" ]] || fail "$path: reported $seq sequential bytes, file has $size"
    checked=$((checked + 1))
  done < <(grep '^close ' "$events" | awk '{print $2}' | sort -u)
  echo "events: $checked file(s) fully reported"
}

case "$case_name" in
  passthrough)
    mkdir "$work/plain" "$work/ucp"
    run "$work/plain" "" "$HOSTS/file_ops_host" "$work/plain"
    run "$work/ucp" "$UCP_LIB" "$HOSTS/file_ops_host" "$work/ucp"
    same_output "$work/plain" "$work/ucp"
    no_stderr "$work/ucp"
    grep -q "open missing = -1 (ENOENT)" "$work/ucp.out" || fail "ENOENT lost"
    grep -q "write closed fd = -1 (EBADF)" "$work/ucp.out" || fail "EBADF lost"
    grep -q "errno after successful calls = 12345" "$work/ucp.out" || fail "errno clobbered"
    ;;

  tracked)
    # The test hooks track every file the host writes; the host sees no difference, and every
    # byte of every file reached the observer (fwrite, write/writev of ofstream, dups).
    mkdir "$work/plain" "$work/ucp"
    run "$work/plain" "" "$HOSTS/file_ops_host" "$work/plain"
    UCP_TEST_TRACK_DIR="$work/ucp" UCP_TEST_EVENTS="$work/events" \
      run "$work/ucp" "$UCP_TEST_LIB" "$HOSTS/file_ops_host" "$work/ucp"
    same_output "$work/plain" "$work/ucp"
    no_stderr "$work/ucp"
    check_events "$work/events" "$work/ucp"
    for name in a.bin b.bin e.txt f.txt g.txt h.bin; do
      grep -q "^close $work/ucp/$name " "$work/events" || fail "$name was not tracked"
    done
    grep -q "^close $work/ucp/d.bin .*nonseq=1" "$work/events" || fail "sendfile not reported"
    grep -q "^close $work/ucp/a.bin .*positioned=4 .*syncs=2" "$work/events" ||
      fail "pwrite/pwritev or fsync of a.bin not reported: $(grep a.bin "$work/events")"
    grep -q "^rename $work/ucp/c.bin $work/ucp/c2.bin" "$work/events" || fail "rename not reported"
    ;;

  hammer)
    mkdir "$work/plain" "$work/ucp" "$work/tracked"
    run "$work/plain" "" "$HOSTS/hammer_host" "$work/plain" || fail "host failed without ucp"
    run "$work/ucp" "$UCP_LIB" "$HOSTS/hammer_host" "$work/ucp" || fail "host failed under ucp"
    same_output "$work/plain" "$work/ucp"
    UCP_TEST_TRACK_DIR="$work/tracked" UCP_TEST_EVENTS="$work/events" \
      run "$work/tracked" "$UCP_TEST_LIB" "$HOSTS/hammer_host" "$work/tracked" ||
      fail "host failed under the test hooks"
    same_output "$work/plain" "$work/tracked"
    check_events "$work/events" "$work/tracked"
    [[ $(grep -c "^close $work/tracked/t" "$work/events") == 64 ]] || fail "not 64 thread files"
    # The forked child passes through: its files are not tracked.
    ! grep -q "child" "$work/events" || fail "the forked child was intercepted"
    ;;

  tracked_hammer)
    # 64 threads save a DeepSpeed tag through the real tracker while the host forks mid-save:
    # the host sees no difference, the journal holds exactly one record per file the parent
    # wrote, with its size and xxh3 (check.py compares with xxhsum), and the commit of `latest`;
    # the child's tracked file (it passes through) is in no journal. The model states are a real
    # torch file of a 64-rank ZeRO-2 tag, so the index build that the commit starts runs too.
    mkdir "$work/plain" "$work/ucp"
    "$UCP_PYTHON" -c 'import sys, torch; torch.save({"module": {"w": torch.zeros(4)},
      "ds_version": "0.14.5", "dp_world_size": 64, "mp_world_size": 1,
      "ds_config": {"zero_optimization": {"stage": 2}}},
      sys.argv[1])' "$work/model_states.pt"
    run "$work/plain" "" "$HOSTS/tracked_hammer_host" "$work/plain" "$work/model_states.pt" ||
      fail "host failed without ucp"
    RANK=0 run "$work/ucp" "$UCP_LIB" "$HOSTS/tracked_hammer_host" "$work/ucp" \
      "$work/model_states.pt" || fail "host failed under ucp: $(head -5 "$work/ucp.err")"
    same_output "$work/plain" "$work/ucp"
    no_stderr "$work/ucp"
    tag="$work/ucp/global_step1"
    names=$(awk '$1 == "tracked" {print $2}' "$work/ucp.out")
    [[ $(echo "$names" | wc -l) == 65 ]] || fail "the host did not list 65 files"
    # shellcheck disable=SC2086 # one argument per name
    "$UCP_PYTHON" "$(dirname "$0")/../savetrack/check.py" journal "$tag" 0 $names ||
      fail "journal does not match the files"
    journals=("$tag"/.ucp/journal.*.jsonl)
    [[ ${#journals[@]} == 1 ]] || fail "expected the parent's journal only: ${journals[*]}"
    [[ -s "$work/ucp/global_step2/mp_rank_00_model_states.pt" ]] || fail "the child wrote nothing"
    "$UCP_PYTHON" "$(dirname "$0")/../savetrack/check.py" untracked "$work/ucp/global_step2" ||
      fail "the forked child was tracked"
    [[ ! -e "$work/plain/global_step1/.ucp" ]] || fail "a journal without ucp"
    ;;

  logging)
    # Debug logging on, with tracked files (so dispatch logs from inside wrappers): no
    # recursion, no deadlock, same output, and the log file exists.
    mkdir "$work/plain" "$work/ucp" "$work/logs"
    run "$work/plain" "" "$HOSTS/hammer_host" "$work/plain"
    UCP_LOG_LEVEL=debug UCP_LOG_DIR="$work/logs" UCP_TEST_TRACK_DIR="$work/ucp" \
      UCP_TEST_EVENTS="$work/events" run "$work/ucp" "$UCP_TEST_LIB" "$HOSTS/hammer_host" "$work/ucp" ||
      fail "host failed with logging on"
    same_output "$work/plain" "$work/ucp"
    no_stderr "$work/ucp"
    grep -q "tracking fd" "$work"/logs/ucp.*.log || fail "no debug lines in the log"
    mkdir "$work/plain2" "$work/ucp2"
    run "$work/plain2" "" "$HOSTS/file_ops_host" "$work/plain2"
    UCP_LOG_LEVEL=trace UCP_LOG_DIR="$work/logs" run "$work/ucp2" "$UCP_LIB" "$HOSTS/file_ops_host" "$work/ucp2"
    same_output "$work/plain2" "$work/ucp2"
    ;;

  exec)
    mkdir "$work/plain" "$work/ucp" "$work/logs"
    run "$work/plain" "" "$HOSTS/exec_host" "$work/plain"
    UCP_LOG_LEVEL=info UCP_LOG_DIR="$work/logs" run "$work/ucp" "$UCP_LIB" "$HOSTS/exec_host" "$work/ucp"
    same_output "$work/plain" "$work/ucp"
    grep -q "child exit 0: written by the exec'd child" "$work/ucp.out" || fail "child failed"
    # The parent and the exec'd child each started ucp (the forked, not yet exec'd, child did not).
    [[ $(grep -l "started in pid" "$work"/logs/ucp.*.log | wc -l) == 2 ]] ||
      fail "expected two started processes: $(ls "$work/logs")"
    ;;

  early)
    # Another preloaded library does I/O in its constructor; in one of the two orders its
    # constructor runs before ucp's, calling ucp's wrappers before ucp started.
    mkdir "$work/plain"
    UCP_TEST_EARLY_FILE="$work/early0" run "$work/plain" "$UCP_EARLY_LIB" "$HOSTS/file_ops_host" "$work/plain"
    grep -q "early: write ok stat ok ENOENT ok" "$work/plain.out" || fail "early lib broken"
    for order in "$UCP_EARLY_LIB $UCP_LIB" "$UCP_LIB $UCP_EARLY_LIB"; do
      rm -rf "$work/ucp" && mkdir "$work/ucp"
      UCP_TEST_EARLY_FILE="$work/early0" run "$work/ucp" "$order" "$HOSTS/file_ops_host" "$work/ucp"
      same_output "$work/plain" "$work/ucp"
      no_stderr "$work/ucp"
    done
    ;;

  disable)
    # UCP_DISABLE=1 (and UCP_MODE=off): hooks installed by the test library never run.
    printf 'served' >"$work/b"
    printf 'original' >"$work/a"
    run "$work/plain" "" "$HOSTS/substitute_host" "$work/a"
    for setting in UCP_DISABLE=1 UCP_MODE=off; do
      mkdir -p "$work/ucp"
      (
        export "${setting?}"
        UCP_TEST_SUBSTITUTE="$work/a=$work/b" UCP_TEST_TRACK_DIR="$work/ucp" \
          UCP_TEST_EVENTS="$work/events" run "$work/off" "$UCP_TEST_LIB" "$HOSTS/substitute_host" "$work/a"
        same_output "$work/plain" "$work/off"
        no_stderr "$work/off"
        UCP_TEST_TRACK_DIR="$work/ucp" UCP_TEST_EVENTS="$work/events" \
          run "$work/off" "$UCP_TEST_LIB" "$HOSTS/file_ops_host" "$work/ucp"
        [[ ! -e "$work/events" ]] || fail "$setting: events were recorded"
      )
      rm -rf "$work/ucp"
    done
    ;;

  bad_config)
    # A bad value: exactly one line on stderr, then pure pass-through.
    mkdir "$work/plain" "$work/ucp"
    run "$work/plain" "" "$HOSTS/file_ops_host" "$work/plain"
    UCP_MODE=fast run "$work/ucp" "$UCP_LIB" "$HOSTS/file_ops_host" "$work/ucp"
    same_output "$work/plain" "$work/ucp"
    expected="ucp: UCP_MODE=fast is invalid (expected index, atoms or off); ucp is disabled for this process"
    [[ "$(cat "$work/ucp.err")" == "$expected" ]] || fail "stderr was: $(cat "$work/ucp.err")"
    printf 'served' >"$work/b"
    printf 'original' >"$work/a"
    run "$work/orig" "" "$HOSTS/substitute_host" "$work/a"
    UCP_TOPOLOGY=tp=0 UCP_TEST_SUBSTITUTE="$work/a=$work/b" \
      run "$work/bad" "$UCP_TEST_LIB" "$HOSTS/substitute_host" "$work/a"
    same_output "$work/orig" "$work/bad"
    [[ $(wc -l <"$work/bad.err") == 1 ]] && grep -q "^ucp: UCP_TOPOLOGY=tp=0 is invalid" "$work/bad.err" ||
      fail "stderr was: $(cat "$work/bad.err")"
    ;;

  substitute)
    # Path a served from b: every read-side call sees b; without the policy, a.
    printf 'the substitute, longer' >"$work/b"
    printf 'original' >"$work/a"
    run "$work/want_b" "" "$HOSTS/substitute_host" "$work/b"
    run "$work/want_a" "" "$HOSTS/substitute_host" "$work/a"
    UCP_TEST_SUBSTITUTE="$work/a=$work/b" run "$work/served" "$UCP_TEST_LIB" "$HOSTS/substitute_host" "$work/a"
    same_output "$work/want_b" "$work/served"
    no_stderr "$work/served"
    # Relative paths are resolved against the cwd before the policy sees them.
    (cd "$work" && UCP_TEST_SUBSTITUTE="$work/a=$work/b" run "$work/relative" "$UCP_TEST_LIB" "$HOSTS/substitute_host" ./x/../a)
    same_output "$work/want_b" "$work/relative"
    UCP_TEST_SUBSTITUTE="$work/a=$work/b" run "$work/plain_lib" "$UCP_LIB" "$HOSTS/substitute_host" "$work/a"
    same_output "$work/want_a" "$work/plain_lib"
    # A substitute that is missing falls back to the original...
    UCP_TEST_SUBSTITUTE="$work/a=$work/missing" run "$work/fallback" "$UCP_TEST_LIB" "$HOSTS/substitute_host" "$work/a"
    same_output "$work/want_a" "$work/fallback"
    # ...unless UCP_STRICT=1, where the call fails with EIO.
    UCP_STRICT=1 UCP_TEST_SUBSTITUTE="$work/a=$work/missing" run "$work/strict" "$UCP_TEST_LIB" "$HOSTS/substitute_host" "$work/a"
    grep -q "^stat: -1$" "$work/strict.out" || fail "strict substitution did not fail"
    ;;

  exports)
    # Only the hooked names and ucp_version are exported; nothing C++ leaks.
    expected=$(perl -0pe 's:/\*.*?\*/::gs' "$EXPORTS_MAP" | tr -s ' ;:{}\n' '\n' |
      grep -E '^[A-Za-z_][A-Za-z0-9_]*$' | grep -vE '^(global|local)$' | sort)
    actual=$(nm -D --defined-only "$UCP_LIB" | awk '{print $3}' | sort)
    [[ "$expected" == "$actual" ]] || { diff <(echo "$expected") <(echo "$actual") >&2; fail "exports differ"; }
    [[ $(echo "$actual" | wc -l) -ge 60 ]] || fail "too few exports"
    ! readelf --dyn-syms -W "$UCP_LIB" | grep -E ' (GLOBAL|WEAK) .* [0-9]+ _Z' | grep -v UND ||
      fail "C++ symbols exported"
    # Dependencies: the C and C++ runtimes only (never CUDA, NCCL, libunwind, spdlog, fmt).
    deps=$(readelf -d "$UCP_LIB" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | sort | tr '\n' ' ')
    echo "libucp.so needs: $deps"
    for dep in $deps; do
      case "$dep" in
        libc.so.6 | libstdc++.so.6 | libm.so.6 | libgcc_s.so.1 | libdl.so.2 | libpthread.so.0 | ld-linux-x86-64.so.2) ;;
        libasan.so.* | libubsan.so.* | libtsan.so.*) ;;  # sanitizer builds
        *) fail "unexpected dependency $dep" ;;
      esac
    done
    ;;

  torch)
    mkdir "$work/plain" "$work/ucp" "$work/tracked"
    run "$work/plain" "" "$UCP_PYTHON" "$(dirname "$0")/torch_roundtrip.py" "$work/plain" ||
      fail "torch script failed without ucp: $(tail -3 "$work/plain.err")"
    run "$work/ucp" "$UCP_LIB" "$UCP_PYTHON" "$(dirname "$0")/torch_roundtrip.py" "$work/ucp" ||
      fail "torch script failed under ucp: $(tail -3 "$work/ucp.err")"
    same_output "$work/plain" "$work/ucp"
    grep -q "^equal True" "$work/ucp.out" || fail "round trip not equal"
    cmp -s "$work/plain/model_states.pt" "$work/ucp/model_states.pt" || fail "saved files differ"
    UCP_TEST_TRACK_DIR="$work/tracked" UCP_TEST_EVENTS="$work/events" \
      run "$work/tracked" "$UCP_TEST_LIB" "$UCP_PYTHON" "$(dirname "$0")/torch_roundtrip.py" "$work/tracked"
    same_output "$work/plain" "$work/tracked"
    grep -q "^close $work/tracked/model_states.pt " "$work/events" || fail "torch.save not tracked"
    check_events "$work/events" "$work/tracked"
    ;;

  installed)
    # `cmake --install` puts libucp.so in lib/ and ucp in bin/; the installed library is the
    # same pass-through preload from there.
    cmake --install "$BUILD_ROOT" --prefix "$work/prefix" >"$work/install.log" ||
      fail "cmake --install failed: $(tail -3 "$work/install.log")"
    [[ -f $work/prefix/lib/libucp.so ]] || fail "no lib/libucp.so: $(cat "$work/install.log")"
    "$work/prefix/bin/ucp" --help | grep -q "universal checkpoints" || fail "bin/ucp does not run"
    mkdir "$work/plain" "$work/ucp"
    run "$work/plain" "" "$HOSTS/file_ops_host" "$work/plain"
    run "$work/ucp" "$work/prefix/lib/libucp.so" "$HOSTS/file_ops_host" "$work/ucp"
    same_output "$work/plain" "$work/ucp"
    no_stderr "$work/ucp"
    ;;

  *)
    fail "unknown case"
    ;;
esac
echo "ok: $case_name"
