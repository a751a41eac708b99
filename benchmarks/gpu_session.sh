#!/usr/bin/env bash
# What the next session with a GPU runs first (issue 43): the CUDA kernels of the table against float64
# (pytest -m gpu), then benchmarks/gpu.py's arms (the unpatched model on each SDPA kernel, the fastest as baseline;
# the fold on flash and on cuDNN, FlashAttention-4, flex, the bias path). Three steps, two of them device calls.
#
# 1. Here, where pip reaches PyPI (no GPU needed; a few minutes):
#        bash benchmarks/gpu_session.sh prepare
#    downloads FlashAttention-4 and its needs as wheels for the device's Python 3.12 / CUDA 13 into .whl/ (a folder
#    that ignores itself: its own .gitignore says '*'). nvidia-cutlass-dsl-libs-cu13's wheel (92 MB) is more than one call may carry (64 MiB), so it travels in two
#    parts: .whl/a/ (60 MiB) and .whl/b/ (the rest, with the small wheels).
# 2. Device call 1 (carry [".whl/a"], ~1 min of device time once the machine is up):
#        bash benchmarks/gpu_session.sh stash
#    keeps the first part in .whlstash/ (ignored: the device keeps ignored files between calls while it is warm).
# 3. Device call 2, at once (carry [".whl/b"], timeout_s 600; about 9 minutes):
#        bash benchmarks/gpu_session.sh run
#    puts the wheel together, installs the wheels under /tmp/site, prints what it found, runs the GPU tests, then the
#    benchmark (GPT-2 and Llama at 1k / 4k / 16k, then Falcon-RW at 2048), each step under its own time
#    limit, everything teed to $OUT/gpu_session.log. The table is the last thing printed.
# Without flash-attn-4 (step 1 skipped), `run` still runs the cuDNN checks and every other arm.
set -uo pipefail
cd "$(dirname "$0")/.."

FA4_WHEELS=(
    "flash-attn-4==4.0.0b36" "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1"
    "quack-kernels==0.6.5" "apache-tvm-ffi==0.1.15.post2" "torch-c-dlpack-ext==0.1.5" "transformers==5.24.0"
)
BIG_WHEEL="nvidia-cutlass-dsl-libs-cu13==4.8.1"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

download() {  # wheels for the device's CPython 3.12 on x86-64, without their dependencies (named above)
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$@"
}

prepare() {
    rm -rf .whl && mkdir -p .whl/a .whl/b /tmp/hf_alibi_big_wheel
    echo '*' > .whl/.gitignore  # the folder ignores itself: it travels only where a call carries it
    download .whl/b "${FA4_WHEELS[@]}" || exit 1
    download /tmp/hf_alibi_big_wheel "$BIG_WHEEL" || exit 1
    big=$(ls /tmp/hf_alibi_big_wheel/nvidia_cutlass_dsl_libs_cu13-*.whl)
    split -b 60m -d "$big" ".whl/a/$(basename "$big").part-"
    mv ".whl/a/$(basename "$big").part-01" .whl/b/
    du -sh .whl/a .whl/b
}

stash() {
    mkdir -p .whlstash && echo '*' > .whlstash/.gitignore && cp .whl/a/*.part-* .whlstash/ && ls -la .whlstash
}

run() {
    OUT=${OUT:-/tmp/gpu_session_out}
    mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1
    site=/tmp/site
    if ls .whl/b/*.part-* >/dev/null 2>&1 && ls .whlstash/*.part-* >/dev/null 2>&1; then
        name=$(basename "$(ls .whlstash/*.part-00)" .part-00)
        cat .whlstash/"$name".part-* .whl/b/"$name".part-* > "/tmp/$name"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            .whl/b/*.whl "/tmp/$name" || echo "wheel install failed: FA4 arms will be skipped"
    elif ls .whl/b/*.whl >/dev/null 2>&1; then
        echo "no stashed part of the cutlass libs (step 2 not run on this machine): installing the rest only"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            .whl/b/*.whl
    fi
    export PYTHONPATH="$site:$PWD:$PWD/tests:$PWD/benchmarks"
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        python3 - <<'PY'
import torch, transformers
print("torch", torch.__version__, "cuDNN", torch.backends.cudnn.version(), "transformers", transformers.__version__,
      "cudnn_sdp_enabled", torch.backends.cuda.cudnn_sdp_enabled())
try:
    from flash_attn.cute import flash_attn_func  # noqa: F401
    import cutlass
    print("flash-attn-4 importable; cutlass", getattr(cutlass, "__version__", "?"))
except Exception as error:  # noqa: BLE001
    print("flash-attn-4 not importable:", type(error).__name__, str(error)[:300])
PY
        echo "== pytest -m gpu (the table's CUDA kernels, the fold, flex, flash-attn 2 where installed)"
        # time limits that sum under one call's 600 s; each step prints as it goes, so a cut step still reports
        timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/core/test_gpu_kernels.py \
            tests/core/test_folded_half.py tests/core/test_attention_paths.py 2>&1 | tail -25
        echo "== benchmarks/gpu.py: GPT-2, Llama (bias and flex were measured on 2026-11-26: docs/performance.md)"
        timeout 300 python3 benchmarks/gpu.py --lengths 1024 4096 16384 --repeats 3 --gen-repeats 2 \
            --new-tokens 32 --no-main-job --types gpt2 llama --arms fold-cudnn fa4 fold-flash
        echo "== benchmarks/gpu.py: Falcon-RW against transformers' own, if time is left"
        timeout 90 python3 benchmarks/gpu.py --lengths 2048 --repeats 3 --gen-repeats 2 --new-tokens 32 \
            --no-main-job --types falcon --arms fold-cudnn fa4
    } 2>&1 | tee "$OUT/gpu_session.log"
}

case "${1:-}" in
    prepare) prepare ;;
    stash) stash ;;
    run) run ;;
    *) echo "usage: bash benchmarks/gpu_session.sh prepare | stash | run (see the comment at its top)"; exit 2 ;;
esac
