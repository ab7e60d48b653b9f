#!/usr/bin/env bash
# The one set-up of the project, used by demo/run.sh, tests/run.sh and .ci/run: installs what is
# missing and says what it installs; costs a second or two when everything is present.
#   1. the Debian packages in tools/debian-packages.txt (apt-get; sudo when not root);
#   2. the project's virtual environment (UCP_VENV, default .venv) with the Python packages pinned
#      in tools/requirements.txt, torch first so that nothing else can pull in a CUDA build; and
#      .venv-deepspeed-0.14.5: DeepSpeed v0.14.5 (tools/requirements-deepspeed-0.14.5.txt) over
#      Debian's torch 1.13, for the tests of the release the fixtures were written with.
# Offline or without permission it names what is missing and the command that installs it, and
# exits 1. Usage: tools/setup.sh [--no-venv]   (--no-venv: the Debian packages only)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
packages_file=$root/tools/debian-packages.txt
requirements_file=$root/tools/requirements.txt
requirements_deepspeed_0145=$root/tools/requirements-deepspeed-0.14.5.txt
venv=${UCP_VENV:-$root/.venv}
venv_deepspeed_0145=$root/.venv-deepspeed-0.14.5
# Python 3.11 (pyenv's python3 here): the interpreter the pinned torch wheel is built for.
base_python=${UCP_SETUP_PYTHON:-python3}

with_venv=1
case "${1:-}" in
  --no-venv) with_venv=0 ;;
  "") ;;
  *) echo "usage: tools/setup.sh [--no-venv]" >&2; exit 2 ;;
esac

say() { echo "setup: $*" >&2; }
# fail MESSAGE... COMMAND: says what is missing and the command that installs it; exits 1.
fail() {
  say "${*:1:$#-1}"
  say "run this, then try again:"
  echo "    ${!#}" >&2
  exit 1
}

# --- 1. Debian packages ------------------------------------------------------------------------
mapfile -t packages < <(grep -v '^[[:space:]]*\(#\|$\)' "$packages_file")
declare -A installed=()
while read -r package status; do
  [[ $status == installed ]] && installed[$package]=1
done < <(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${packages[@]}" 2>/dev/null || true)
missing=()
for package in "${packages[@]}"; do
  [[ -n ${installed[$package]:-} ]] || missing+=("$package")
done
if ((${#missing[@]})); then
  install_command="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
  if ((EUID == 0)); then
    sudo=()
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    fail "missing Debian packages: ${missing[*]} (installing them needs root, and sudo is not" \
      "available without a password)" "sudo sh -c '$install_command'"
  fi
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # apt-get's and dpkg's progress goes to a log, shown only when they fail.
  apt_log=$(mktemp "${TMPDIR:-/tmp}/ucp-setup-apt.XXXXXX")
  trap 'rm -f "$apt_log"' EXIT
  if ! "${sudo[@]}" apt-get update -qq >"$apt_log" 2>&1 ||
    ! "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" \
      >>"$apt_log" 2>&1; then
    grep -E '^(E|W): ' "$apt_log" >&2 || tail -20 "$apt_log" >&2
    fail "apt-get could not install ${missing[*]} (offline, or no Debian mirror reachable?)" \
      "${sudo[*]:+sudo }sh -c '$install_command'"
  fi
fi
((with_venv)) || exit 0

# --- 2. The virtual environments ---------------------------------------------------------------
# pip's own notes on this machine's configuration (find-links folders that do not exist) are noise.
quiet_pip() { "$1/bin/python" -m pip "${@:2}" 2> >(grep -v '^WARNING: Location' >&2); }

# deepspeed_ops_built DIR OP...: whether DIR's DeepSpeed was installed with each named op compiled
# for the cpu accelerator (its `installed_ops`, where setup.py records a built op as 1).
deepspeed_ops_built() {
  local info op
  info=$(ls "$1"/lib/python3*/site-packages/deepspeed/git_version_info_installed.py 2>/dev/null) ||
    return 1
  grep -q "^accelerator_name='cpu'" "$info" || return 1
  for op in "${@:2}"; do
    grep -Eq "'$op': (True|1)[,}]" "$info" || return 1
  done
}

# make_venv DIR PYTHON REQUIREMENTS WHAT OPS [VENV_OPTION...]: DIR made by `PYTHON -m venv` and
# filled with REQUIREMENTS, unless a stamp in it holds the hash of that file and OPS already. A
# torch pin in REQUIREMENTS is installed alone first; the rest then has it as a constraint.
# DeepSpeed ships only a source archive whose setup.py imports torch: built without isolation, it
# sees that torch. OPS ("BUILD_VAR:op_name ..."): DeepSpeed ops compiled when DeepSpeed is
# installed (DS_BUILD_<BUILD_VAR>=1, for the cpu accelerator). Otherwise DeepSpeed compiles them
# at run time into ~/.cache/torch_extensions, one folder per op for every release and torch alike,
# under a lock file that stays when a process is killed while it holds it (each process takes it,
# if only to find the op built): every later DeepSpeed process then waits on it forever.
make_venv() {
  local dir=$1 python=$2 requirements=$3 what=$4 ops=$5
  shift 5
  local stamp=$dir/.ucp-requirements.sha256 wanted
  wanted=$({ cat "$requirements"; echo "ops: $ops"; } | sha256sum | cut -d' ' -f1)
  if [[ -x $dir/bin/python && -f $stamp && $(cat "$stamp") == "$wanted" ]]; then
    return 0
  fi
  if [[ ! -x $dir/bin/python ]]; then
    command -v "$python" >/dev/null ||
      fail "no '$python' to create $dir with" "UCP_SETUP_PYTHON=/path/to/python3.11 $0"
    say "creating the virtual environment $dir ($("$python" --version 2>&1))"
    "$python" -m venv "$@" "$dir" ||
      fail "'$python -m venv $* $dir' failed" "apt-get install -y python3-venv"
  fi
  say "installing into $dir the $(grep -c '==' "$requirements") packages pinned in" \
    "$requirements ($what)"
  local torch_pin constraint=() build_env=(DS_ACCELERATOR=cpu) op_names=() op
  torch_pin=$(grep -m1 '^torch==' "$requirements" || true)
  if [[ -n $torch_pin ]]; then
    echo "$torch_pin" >"$dir/.ucp-torch-constraint.txt"
    constraint=(-c "$dir/.ucp-torch-constraint.txt")
  fi
  for op in $ops; do
    build_env+=("DS_BUILD_${op%%:*}=1")
    op_names+=("${op#*:}")
  done
  if { [[ -n $torch_pin ]] && ! quiet_pip "$dir" install -q --disable-pip-version-check \
    "$torch_pin" >&2; } ||
    ! (export "${build_env[@]}" && quiet_pip "$dir" install -q --disable-pip-version-check \
      --no-build-isolation "${constraint[@]}" -r "$requirements" >&2); then
    fail "pip could not install the packages of $requirements (offline, or PyPI not" \
      "reachable?)" "$dir/bin/python -m pip install --no-build-isolation -r $requirements"
  fi
  # DeepSpeed already installed, or a wheel pip built earlier without the ops: built once more.
  if ((${#op_names[@]})) && ! deepspeed_ops_built "$dir" "${op_names[@]}"; then
    local deepspeed_pin
    deepspeed_pin=$(grep -m1 '^deepspeed==' "$requirements")
    say "building DeepSpeed's ops ${op_names[*]} into $dir ($deepspeed_pin, once)"
    (export "${build_env[@]}" && quiet_pip "$dir" install -q --disable-pip-version-check \
      --no-build-isolation --no-cache-dir --force-reinstall --no-deps "${constraint[@]}" \
      "$deepspeed_pin" >&2) && deepspeed_ops_built "$dir" "${op_names[@]}" ||
      fail "DeepSpeed's ops ${op_names[*]} did not build into $dir" \
        "${build_env[*]} $dir/bin/python -m pip install --no-build-isolation --no-cache-dir \
--force-reinstall --no-deps $deepspeed_pin"
  fi
  echo "$wanted" >"$stamp"
  say "the virtual environment $dir is ready"
}

# The ops the tests load: the shared-memory all-reduce every CPU process of DeepSpeed builds at
# init_distributed, and the CPU FusedAdam a config's "AdamW" optimizer makes (the HF Trainer test).
make_venv "$venv" "$base_python" "$requirements_file" \
  "torch, DeepSpeed, transformers, accelerate and what they need" \
  "SHM_COMM:deepspeed_shm_comm FUSED_ADAM:fused_adam"
# DeepSpeed v0.14.5, the release the fixtures in ../shared were written with, over Debian's torch
# 1.13 (/usr/bin/python3's, seen through --system-site-packages): its live tests run too. No ops:
# Debian's torch has no C++ headers, so that DeepSpeed finds every op incompatible and builds none.
make_venv "$venv_deepspeed_0145" /usr/bin/python3 "$requirements_deepspeed_0145" \
  "DeepSpeed v0.14.5 on Debian's torch 1.13" "" --system-site-packages
