#!/usr/bin/env bash
# The device check on a TPU VM: the same stages as scripts/device_check.sh (kernels, the engine
# served at a Qwen3-8B shape with random weights, transformers beside it, every feature once), for
# users who have one. Install first: pip install -e '.[tpu,test]'   (torch for the peer stage)
#
#   bash scripts/tpu_check.sh                  # results in $OUT, else ./device-check
#   bash scripts/tpu_check.sh --dry-run        # any machine: tiny shapes on the CPU
set -u
cd "$(dirname "$0")/.."
DEVICE_CHECK_PLATFORM=tpu exec bash scripts/device_check.sh "$@"
