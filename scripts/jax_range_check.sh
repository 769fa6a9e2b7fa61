#!/usr/bin/env bash
# jaxserve on the newest jax the package declares (0.11), as the lent GPU machine's image has it:
# Python 3.12, jax/jaxlib 0.11.2 with the CUDA 13 plugin (compile-only here) and libtpu, and the
# image's transformers 5.17.0, tokenizers 0.23.2, numpy 2.5.2 and safetensors 0.8.0; the rest of
# jaxserve's runtime dependencies come from the wheels scripts/device_wheels.sh fetches, installed
# with `pip --no-index --no-deps --target` exactly as scripts/device_check.sh installs them there.
# CI runs the suite on the pinned jax (0.10.2); this is the other end of the range, run by hand:
#
#   bash scripts/jax_range_check.sh [VENV]     # needs python3.12 on PATH (or $PYTHON312); ~30 min on 2 cores
#
# Runs the engine, LLM, server, parity, kernel, quantization, speculation, structured-output and
# MoE test files, every gpu_compile and TPU compile test, and the device check's dry run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/tmp/jaxserve-jax011}
PY=${PYTHON312:-python3.12}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q "jax[cuda13,tpu]==0.11.2" flax orbax-checkpoint transformers==5.17.0 tokenizers==0.23.2 \
    numpy==2.5.2 safetensors==0.8.0 huggingface_hub prometheus-client jinja2 httpx tqdm ml_dtypes absl-py tiktoken \
    jaxtyping pytest==9.0.* pytest-xdist==3.8.0 hypothesis torch==2.13.0 openai scipy jsonschema
fi
bash scripts/device_wheels.sh .whl >/dev/null
rm -rf "$VENV/carried" && "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --target "$VENV/carried" .whl/*.whl
export PYTHONPATH="$VENV/carried:$PWD"
"$VENV/bin/python" -c "import jax; print('jax', jax.__version__)"
"$VENV/bin/python" -m pytest -p no:cacheprovider -n 2 -q \
  tests/test_engine.py tests/test_llm.py tests/server/test_server_generation.py tests/model/test_parity.py \
  tests/kernels/test_rpa_reference.py tests/kernels/test_rpa_gpu.py tests/kernels/test_rpa_tpu.py \
  tests/quant/test_quantized_engine.py tests/speculative/test_spec_engine.py tests/structured/test_structured_engine.py \
  tests/model/test_moe.py tests/test_random_init.py
"$VENV/bin/python" -m pytest -p no:cacheprovider -n 2 -q -m "gpu_compile or not (gpu or tpu)" \
  tests/kernels/test_rpa_gpu_compile.py tests/kernels/test_rpa_tiled_compile.py tests/kernels/test_rpa_tpu_compile.py \
  tests/test_target_compile.py tests/quant/test_quantized_compile.py tests/test_gpu_target.py
PATH="$VENV/bin:$PATH" bash scripts/device_check.sh --dry-run --out "$VENV/device-check"
