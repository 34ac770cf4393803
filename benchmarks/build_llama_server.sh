#!/usr/bin/env bash
# llama.cpp's C++ llama-server, built from the llama.cpp vendored in the SAME llama-cpp-python sdist
# that benchmarks/peers-requirements.txt pins, so the server peer runs the kernels llama-bench runs.
# Also llama-quantize and llama-bench (the big-export benchmark's peer: convert_hf_to_gguf.py, then
# quantize, then decode speed) and llama-perplexity (the GGUF import check, benchmarks/gguf_import.py)
# from the same tree. No curl/openssl (the benchmark serves a local GGUF), niced, -j2: the box is shared.
# Output: benchmarks/.peers-build/{llama-server,llama-quantize,llama-bench,llama-perplexity} and .peers-build/llama.cpp
# (the source tree, for convert_hf_to_gguf.py and its gguf-py); cached, a rerun is a no-op.
set -euo pipefail
cd "$(dirname "$0")"
VERSION="$(sed -n 's/^llama-cpp-python==\([0-9.]*\).*/\1/p' peers-requirements.txt)"
BUILD=.peers-build
BIN="$BUILD/llama-server"
TOOLS=(llama-server llama-quantize llama-bench llama-perplexity)
if [[ -x "$BIN" && -x "$BUILD/llama-quantize" && -x "$BUILD/llama-bench" && -x "$BUILD/llama-perplexity" && -f "$BUILD/VERSION" && "$(cat "$BUILD/VERSION")" == "$VERSION" ]]; then
  echo "llama-server $VERSION already built: $BIN"; exit 0
fi
mkdir -p "$BUILD/src"
SDIST="$BUILD/src/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" && -n "${LLAMA_CPP_SDIST:-}" ]]; then
  cp "$LLAMA_CPP_SDIST" "$SDIST"  # an sdist pip already fetched (its exact file name carries the version)
fi
if [[ ! -f "$SDIST" ]]; then
  # Only this package from source; its build backend comes as a wheel (":all:" would compile that too).
  python3 -m pip download -q --no-deps --no-binary llama-cpp-python -d "$BUILD/src" "llama-cpp-python==$VERSION"
fi
rm -rf "$BUILD/src/llama_cpp_python-$VERSION"
tar -xzf "$BUILD/src/llama_cpp_python-$VERSION.tar.gz" -C "$BUILD/src"
LLAMA="$BUILD/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
nice -n 10 cmake -S "$LLAMA" -B "$BUILD/cmake" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON
nice -n 10 cmake --build "$BUILD/cmake" --target "${TOOLS[@]}" -j "${JOBS:-2}"
for tool in "${TOOLS[@]}"; do
  cp "$(find "$BUILD/cmake" -type f -name "$tool" -perm -u+x | head -1)" "$BUILD/$tool"
done
ln -sfn "src/llama_cpp_python-$VERSION/vendor/llama.cpp" "$BUILD/llama.cpp"
echo "$VERSION" > "$BUILD/VERSION"
"$BIN" --version 2>&1 | head -2 || true
echo "built $BIN"
