#!/usr/bin/env bash
# The NCCL hook checks that need a GPU, for a lent GPU machine (CI has none): the real-NCCL host
# built there against the NCCL of torch's wheel, then torch's NCCL process group.
#   tests/nccl/on_gpu.sh LIBUCP     (libucp.so built here, in Release: the debug build is 90 MB)
set -euo pipefail
libucp=$(realpath "$1")
here=$(dirname "$(realpath "$0")")
root=$(realpath "$here/../..")
work=$(mktemp -d)
# torch's wheel carries its NCCL (nvidia-nccl-cu*); CUDA's own copy is the fallback.
nccl_so=$(python3 -c 'import glob, sys
hits = [h for d in sys.path for h in glob.glob(d + "/nvidia/**/libnccl.so.2", recursive=True)]
print((hits or glob.glob("/usr/local/cuda/lib64/libnccl.so.2") or [""])[0])')
[[ -n $nccl_so ]] || { echo "no libnccl.so.2 found" >&2; exit 1; }
cc -O2 -I"$root" -o "$work/real_nccl_host" "$here/real_nccl_host.c" "$nccl_so" \
  -Wl,-rpath,"$(dirname "$nccl_so")"
echo "NCCL: $nccl_so"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
echo "== real NCCL host"
python3 "$here/check_nccl_hooks.py" real "$libucp" "$work/real_nccl_host"
echo "== torch NCCL process group"
python3 "$here/check_torch_nccl.py" "$libucp"
echo "== torch NCCL process group of 4 ranks on the one GPU"
python3 "$here/check_torch_nccl_ranks.py" "$libucp" 4
echo "== all GPU checks passed"
