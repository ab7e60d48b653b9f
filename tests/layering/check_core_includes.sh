#!/usr/bin/env bash
# check_core_includes.sh SOURCE_DIR CXX "INCLUDE_DIRS" (a CMake list: ';'-separated)
# Fails, naming the file and line, when a file under core/ includes anything from hooks/ or
# interpose/, directly or through "../"; and fails when the compiler, given core's include
# directories, would build such an include (the enforcement in core/CMakeLists.txt is gone).
set -u
source_dir=$1 cxx=$2
IFS=';' read -r -a include_dirs <<<"$3"
status=0

offending=$(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]([^">]*/)?(\.\./)*(hooks|interpose)/' \
  "$source_dir/core" --include='*.h' --include='*.cc')
relative=$(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"\.\./' "$source_dir/core" \
  --include='*.h' --include='*.cc')
if [[ -n $offending || -n $relative ]]; then
  echo "core/ must include nothing from hooks/ or interpose/, nor reach out of core/ by '../':"
  printf '%s\n%s\n' "$offending" "$relative" | sed "s|^$source_dir/||" | sort -u | grep -v '^$'
  status=1
fi

flags=()
for dir in "${include_dirs[@]}"; do flags+=("-I$dir"); done
probe_dir=$(mktemp -d)
trap 'rm -rf "$probe_dir"' EXIT
compile() {  # compile PROBE_TEXT: 0 when it compiles with core's include path
  printf '%s\n' "$1" >"$probe_dir/probe.cc"
  "$cxx" -std=c++20 -fsyntax-only "${flags[@]}" "$probe_dir/probe.cc" 2>"$probe_dir/errors"
}
if ! compile '#include "core/util/status.h"'; then
  echo "a probe including core/util/status.h does not compile with core's include path:"
  cat "$probe_dir/errors"
  status=1
fi
for header in hooks/events.h interpose/gate.h; do
  if compile "#include \"$header\""; then
    echo "with core's include path (${include_dirs[*]}), an include of $header compiles: the"
    echo "layering is no longer enforced by the build (core/CMakeLists.txt)"
    status=1
  fi
done
[[ $status == 0 ]] && echo "core includes nothing above core; the build rejects an include of hooks/ or interpose/"
exit $status
