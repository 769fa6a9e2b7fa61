#!/usr/bin/env bash
# Build llama.cpp's `llama-server` once, for the llama-server peer in
# scripts/bench_vs_peers.py.
#
# The sources come from the llama-cpp-python sdist on PyPI (it vendors a
# llama.cpp checkout under vendor/llama.cpp), so only the Python package index
# is needed.  The build is CPU-only, -DGGML_NATIVE=ON (tuned for THIS machine's
# CPU: do not copy the binary to another machine), without libcurl, and builds
# only the llama-server target.
#
# Result (the layout bench_vs_peers.py expects):
#   $LLAMA_CPP_HOME/bin/llama-server
#   $LLAMA_CPP_HOME/convert_hf_to_gguf.py      HF dir -> GGUF converter, with the
#   $LLAMA_CPP_HOME/conversion/                  per-architecture modules it imports and
#   $LLAMA_CPP_HOME/gguf-py/                     its gguf package (found next to it)
#   $LLAMA_CPP_HOME/VERSION                    llama-cpp-python pin it came from
# LLAMA_CPP_HOME defaults to ${JAXSERVE_CACHE:-~/.cache/jaxserve}/llama.cpp, where
# scripts/bench_vs_peers.py looks (or pass it --llama-cpp-home).
#
# Idempotent: exits at once when the binary and the converter of this pin are present.
# Re-run with --force to rebuild.  Takes 6-15 min on 2 cores; the compile runs
# under `nice -n $NICE` (default 10) with $JOBS (default 2) jobs.
#
# Usage:  bash scripts/setup_llama_cpp.sh [--force]
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
LLAMA_CPP_HOME="${LLAMA_CPP_HOME:-${JAXSERVE_CACHE:-$HOME/.cache/jaxserve}/llama.cpp}"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
PYTHON="${PYTHON:-python}"
FORCE=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

BIN="$LLAMA_CPP_HOME/bin/llama-server"
CONVERTER="$LLAMA_CPP_HOME/convert_hf_to_gguf.py"
STAMP="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"

# The converter runs in this Python: warn (do not fail) when a module it imports is missing.
check_converter_imports() {
  "$PYTHON" - <<'PY' || echo "warning: convert_hf_to_gguf.py will fail in $PYTHON; pip install -e '.[bench]'" >&2
import importlib.util, sys
missing = [m for m in ("numpy", "torch", "transformers", "sentencepiece", "yaml", "tqdm", "requests")
           if importlib.util.find_spec(m) is None]
if missing:
    print("missing Python modules for the GGUF converter: " + ", ".join(missing), file=sys.stderr)
    sys.exit(1)
PY
}

if [[ $FORCE -eq 0 && -x "$BIN" && -f "$CONVERTER" \
      && "$(cat "$LLAMA_CPP_HOME/VERSION" 2>/dev/null)" == "$STAMP" ]]; then
  echo "llama-server already built ($STAMP): $BIN"
  check_converter_imports
  exit 0
fi

for tool in cmake "${CXX:-g++}" tar; do
  command -v "$tool" >/dev/null || { echo "setup_llama_cpp.sh: '$tool' not found" >&2; exit 1; }
done

mkdir -p "$LLAMA_CPP_HOME/sdist" "$LLAMA_CPP_HOME/bin"
SDIST="$LLAMA_CPP_HOME/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
  echo "== downloading llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist"
  "$PYTHON" -m pip download --no-binary :all: --no-deps \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$LLAMA_CPP_HOME/sdist"
fi

SRC_ROOT="$LLAMA_CPP_HOME/src"
SRC="$SRC_ROOT/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
  echo "== extracting $SDIST"
  rm -rf "$SRC_ROOT"
  mkdir -p "$SRC_ROOT"
  tar xzf "$SDIST" -C "$SRC_ROOT"
fi
[[ -f "$SRC/CMakeLists.txt" ]] || { echo "no vendor/llama.cpp in $SDIST" >&2; exit 1; }

BUILD="$LLAMA_CPP_HOME/build"
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
start=$(date +%s)
echo "== configuring ($SRC -> $BUILD)"
cmake -S "$SRC" -B "$BUILD" "${GENERATOR[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON
echo "== building llama-server with -j$JOBS (nice $NICE)"
nice -n "$NICE" cmake --build "$BUILD" --config Release --target llama-server -j "$JOBS"

built="$BUILD/bin/llama-server"
[[ -x "$built" ]] || { echo "build finished but $built is missing" >&2; exit 1; }
rm -f "$LLAMA_CPP_HOME/VERSION"
install -m 0755 "$built" "$BIN"
cp "$SRC/convert_hf_to_gguf.py" "$CONVERTER"
for dir in conversion gguf-py; do
  rm -rf "${LLAMA_CPP_HOME:?}/$dir"
  if [[ -d "$SRC/$dir" ]]; then cp -r "$SRC/$dir" "$LLAMA_CPP_HOME/$dir"; fi
done
echo "$STAMP" > "$LLAMA_CPP_HOME/VERSION"   # last: marks a complete install
echo "== built in $(( $(date +%s) - start )) s"
check_converter_imports
echo "llama-server: $BIN"
echo "converter:    $CONVERTER (PYTHONPATH=$LLAMA_CPP_HOME/gguf-py)"
