#!/usr/bin/env bash
# The GPU check (pallas_kernels/lab/gpu_check.py): run from anywhere; writes ${OUT:-.}/gpu_check.json and its logs.
#   bash pallas_kernels/lab/gpu_check.sh [--stages main,rollout_scale] [--total_s 570] [--no_install] [--smoke]
set -u
cd "$(dirname "$0")/../.."
PY="${PYTHON:-$(command -v python || command -v python3)}"
exec "$PY" pallas_kernels/lab/gpu_check.py --out "${OUT:-.}/gpu_check.json" "$@"
