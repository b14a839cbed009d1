#!/usr/bin/env bash
# Optional: install llama-cpp-python (builds llama.cpp from source, ~10 min on 2 cores) and unpack
# llama.cpp's own convert_hf_to_gguf.py (+ its gguf-py and conversion/ packages) from the same
# source distribution into benchmarks/.llama_cpp/, for benchmarks/throughput.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$PY" -m pip install llama-cpp-python
tmp=$(mktemp -d)
"$PY" -m pip download --no-deps --no-binary :all: -d "$tmp" llama-cpp-python
tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
src=$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
mkdir -p benchmarks/.llama_cpp
cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" benchmarks/.llama_cpp/
echo "llama.cpp converter in benchmarks/.llama_cpp/"
