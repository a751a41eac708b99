#!/usr/bin/env bash
# The GPU lease runbook: what to run on a lent GPU machine (one device call at most 10 minutes, 15 device minutes in
# all, 64 MiB carried a call). Each step checks the CUDA kernels against float64 (pytest -m gpu), then times
# benchmarks/gpu.py's and benchmarks/gpu_attention.py's arms against the fastest unpatched SDPA kernel.
# FlashAttention-4's libraries (one 92 MB wheel) are more than one call may carry, so they travel in two halves:
# the first call of a pair keeps its half on the machine (a warm device keeps ignored files between calls), the
# second puts the wheel together.
#
# Here, where pip reaches PyPI (no GPU needed; a minute):
#     bash tools/gpu_lease.sh prepare          # .whl/a (transformers, the first 45 MiB of the cutlass libs),
#                                              # .whl/b (the rest, FA4's wheels), .whl/c (run_clm's needs)
#     bash tools/gpu_lease.sh prepare_cudnn    # .whl/d (nvidia-cudnn-frontend, transformers; 25 MB)
# .whl/ ignores itself: it travels only where a call carries it. Then on the device, one step a call:
#     part1          carry [".whl/a"], timeout_s 420: the cuDNN-fold GPU tests; GPT-2 / Llama at 1k / 4k / 16k (the
#                    fold on cuDNN and on flash, the bias path); Falcon-RW at 2048 against transformers' own
#     part2          carry [".whl/b"], right after part1: FA4's GPU tests, GPT-2 / Llama on FA4
#     choice         carry [".whl/a"], ~4 min: the automatic choice on CUDA checked and timed (auto, fold, bias)
#     attention      carry [".whl/a"], timeout_s 360: every GPU test but FA4's, one attention call timed apart from
#                    the model, training at batch 8
#     attention_fa4  carry [".whl/b"], right after attention: FA4's tests, FA4 with and without its ALiBi score_mod
#     batch          carry [".whl/c"], timeout_s 300: every GPU test but FA4's (the FSDP launches of run_clm
#                    included), training at batch 8
#     cudnn          carry [".whl/d"], timeout_s 420: cuDNN's fused ALiBi against float64, one attention call with
#                    and without dropout, training steps at 8 x 1k, 8 x 4k, 1 x 16k
#     cudnn_dropout  carry [".whl/d"], timeout_s 240: the same training steps with the types' default dropouts
# e.g. run(command="bash tools/gpu_lease.sh part1", carry=[".whl/a"], timeout_s=420). Everything is teed to
# $OUT/gpu_lease_<step>.log; each step runs under its own time limits, so a cut step still reports.
# CONTRIBUTING.md ("GPU lease") says when to run which; docs/performance.md holds the figures.
set -uo pipefail
cd "$(dirname "$0")/.."

FA4_WHEELS=(
    "flash-attn-4==4.0.0b36" "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1"
    "nvidia-cutlass-dsl-libs-core==4.8.1"
    "quack-kernels==0.6.5" "apache-tvm-ffi==0.1.15.post2" "torch-c-dlpack-ext==0.1.5" "transformers==5.24.0"
)
BIG_WHEEL="nvidia-cutlass-dsl-libs-cu13==4.8.1"
RUN_CLM_WHEELS=("datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" "gguf==0.19.0")  # FSDP's run_clm launch
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

download() {  # wheels for the device's CPython 3.12 on x86-64, without their dependencies (named above)
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$@"
}

prepare() {
    rm -rf .whl && mkdir -p .whl/a .whl/b .whl/c /tmp/hf_alibi_big_wheel
    echo '*' > .whl/.gitignore  # the folder ignores itself: it travels only where a call carries it
    download .whl/b "${FA4_WHEELS[@]}" || exit 1
    download /tmp/hf_alibi_big_wheel "$BIG_WHEEL" || exit 1
    big=$(ls /tmp/hf_alibi_big_wheel/nvidia_cutlass_dsl_libs_cu13-*.whl)
    split -b 45m -d "$big" ".whl/a/$(basename "$big").part-"
    mv ".whl/a/$(basename "$big").part-01" .whl/b/
    mv .whl/b/transformers-*.whl .whl/a/
    mkdir -p .whl/c && cp .whl/a/transformers-*.whl .whl/c/  # the batch call: run_clm's needs the image lacks
    download .whl/c "${RUN_CLM_WHEELS[@]}" || exit 1
    du -sh .whl/a .whl/b .whl/c
}

prepare_cudnn() {  # the frontend's graph API runs without its declared nvidia-cutlass-dsl: --no-deps
    rm -rf .whl/d && mkdir -p .whl/d && echo '*' > .whl/.gitignore
    download .whl/d "nvidia-cudnn-frontend==1.32.0" "transformers==5.24.0" || exit 1
    du -sh .whl/d
}

SITE=/tmp/site

environment() {
    OUT=${OUT:-/tmp/gpu_lease_out}
    mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1
    # nvidia-cutlass-dsl puts its packages on sys.path through a .pth file, which a --target install never runs
    export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD:$PWD/tests:$PWD/benchmarks"
}

install() {  # install the named wheels under $SITE, without their dependencies (the device's image has them)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"
}

stash_part() {  # the first call of a pair keeps its half of the big wheel for the second (a warm device keeps it)
    mkdir -p .whlstash && echo '*' > .whlstash/.gitignore && cp .whl/a/*.part-* .whlstash/
}

install_fa4() {  # the second call: the big wheel put together from both halves, FA4's wheels installed
    if ! ls .whlstash/*.part-00 >/dev/null 2>&1; then
        echo "no stashed part of the cutlass libs (the first call did not run on this machine): FA4 is not installed"
        return
    fi
    name=$(basename "$(ls .whlstash/*.part-00)" .part-00)
    cat .whlstash/"$name".part-* .whl/b/"$name".part-* > "/tmp/$name"
    install .whl/b/*.whl "/tmp/$name" || echo "wheel install failed: FA4 arms will be skipped"
}

describe() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
    python3 - <<'PY'
import torch, transformers
print("torch", torch.__version__, "cuDNN", torch.backends.cudnn.version(), "transformers", transformers.__version__,
      "cudnn_sdp_enabled", torch.backends.cuda.cudnn_sdp_enabled(), torch.cuda.get_device_name())
try:
    from flash_attn.cute import flash_attn_func  # noqa: F401
    import cutlass
    print("flash-attn-4 importable; cutlass", getattr(cutlass, "__version__", "?"))
except Exception as error:  # noqa: BLE001
    print("flash-attn-4 not importable:", type(error).__name__, str(error)[:300])
PY
}

part1() {
    environment
    stash_part
    install .whl/a/transformers-*.whl || echo "transformers wheel install failed: the image's transformers runs"
    {
        describe
        echo "== pytest -m gpu: the fold on cuDNN against float64, the half fold, the attention paths"
        timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not fa4" tests/core/test_gpu_kernels.py \
            tests/core/test_folded_half_gpu.py tests/core/test_attention_flex_flash.py 2>&1 | tail -25
        echo "== benchmarks/gpu.py: GPT-2, Llama: the fold on cuDNN and on flash, the bias path"
        timeout 200 python3 benchmarks/gpu.py --lengths 1024 4096 16384 --repeats 3 --gen-repeats 2 \
            --new-tokens 32 --no-main-job --types gpt2 llama --arms fold-cudnn fold-flash bias
        echo "== benchmarks/gpu.py: Falcon-RW against transformers' own at 2048"
        timeout 70 python3 benchmarks/gpu.py --lengths 2048 --repeats 3 --gen-repeats 2 --new-tokens 32 \
            --no-main-job --types falcon --arms fold-cudnn fold-flash bias
    } 2>&1 | tee "$OUT/gpu_lease_part1.log"
}

part2() {
    environment
    {
        install_fa4
        python3 -c "import transformers; assert transformers.__version__ >= '5.19'" 2>/dev/null \
            || echo "transformers below 5.19 (part1's install is gone): hf_alibi will refuse"
        describe
        echo "== pytest -m gpu: FlashAttention-4's ALiBi score_mod against float64"
        timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -k fa4 tests/core/test_gpu_kernels.py 2>&1 \
            | tail -40
        echo "== benchmarks/gpu.py: GPT-2, Llama on FlashAttention-4"
        timeout 170 python3 benchmarks/gpu.py --lengths 1024 4096 16384 --repeats 3 --gen-repeats 2 \
            --new-tokens 32 --no-main-job --types gpt2 llama --arms fa4
    } 2>&1 | tee "$OUT/gpu_lease_part2.log"
}

choice() {  # the automatic choice on CUDA (dispatch.cuda_prefers_bias) checked and timed: carry [".whl/a"], ~4 min
    environment
    install .whl/a/transformers-*.whl || echo "transformers wheel install failed: the image's transformers runs"
    {
        describe
        echo "== pytest -m gpu: the automatic choice, the folds against float64"
        timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not fa4" tests/core/test_gpu_kernels.py \
            tests/core/test_folded_half_gpu.py 2>&1 | tail -15
        echo "== benchmarks/gpu.py: GPT-2, Llama: auto (what a user gets), the fold on cuDNN, the bias path"
        timeout 170 python3 benchmarks/gpu.py --lengths 1024 4096 8192 16384 --repeats 3 --gen-repeats 2 \
            --new-tokens 32 --no-main-job --types gpt2 llama --arms auto fold-cudnn bias
    } 2>&1 | tee "$OUT/gpu_lease_choice.log"
}

attention() {  # carry [".whl/a"], timeout_s 360: every GPU test but FA4's,
    # one attention call timed apart from the model (gpu_attention.py), and training at batch 8 (gpu.py)
    environment
    stash_part
    install .whl/a/transformers-*.whl || echo "transformers wheel install failed: the image's transformers runs"
    {
        describe
        echo "== pytest -m gpu (all but FA4's)"
        timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not fa4" tests/core tests/training/test_fsdp.py \
            tests/serve/test_vllm_config.py 2>&1 | tail -15
        echo "== benchmarks/gpu_attention.py: one attention call, forward + backward, batch 1 and 8"
        timeout 60 python3 benchmarks/gpu_attention.py --lengths 1024 4096 16384 --arms plain-cudnn plain-flash \
            plain-efficient plain-cudnn-72 bias-kernel bias fold-cudnn fold-channel
        timeout 40 python3 benchmarks/gpu_attention.py --batch 8 --lengths 1024 4096 --arms plain-cudnn plain-flash \
            plain-efficient plain-cudnn-72 bias-kernel bias fold-cudnn fold-channel
        echo "== benchmarks/gpu.py: GPT-2, Llama at batch 8: auto, the fold on cuDNN, the bias path"
        timeout 150 python3 benchmarks/gpu.py --batch 8 --lengths 1024 4096 --repeats 3 --gen-repeats 1 \
            --new-tokens 16 --no-main-job --types gpt2 llama --arms unpatched-flash unpatched-cudnn \
            unpatched-efficient auto fold-cudnn bias
    } 2>&1 | tee "$OUT/gpu_lease_attention.log"
}

attention_fa4() {  # call 2, within the machine's warmth (carry [".whl/b"], timeout_s 300): FA4's tests, FA4 with and
    # without its ALiBi score_mod beside the SDPA arms, one attention call
    environment
    {
        install_fa4
        describe
        echo "== pytest -m gpu: FlashAttention-4's ALiBi score_mod against float64"
        timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -k fa4 tests/core/test_gpu_kernels.py 2>&1 \
            | tail -15
        echo "== benchmarks/gpu_attention.py: FA4 with and without the score_mod, batch 1 and 8"
        timeout 60 python3 benchmarks/gpu_attention.py --lengths 1024 4096 16384 --arms plain-cudnn plain-flash \
            bias fold-cudnn fa4-plain fa4
        timeout 40 python3 benchmarks/gpu_attention.py --batch 8 --lengths 1024 4096 --arms plain-cudnn plain-flash \
            bias fold-cudnn fa4-plain fa4
    } 2>&1 | tee "$OUT/gpu_lease_attention_fa4.log"
}

batch() {  # the automatic choice counting the batch (carry [".whl/c"]: transformers, datasets, dill, multiprocess,
    # gguf, for run_clm under accelerate's FSDP; timeout_s 300): every GPU test but FA4's, then training at batch 8
    environment
    install .whl/c/*.whl || echo "wheel install failed: the image's packages run"
    {
        describe
        echo "== pytest -m gpu (all but FA4's)"
        timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not fa4" tests/core tests/training/test_fsdp.py \
            tests/serve/test_vllm_config.py 2>&1 | tail -60
        echo "== benchmarks/gpu.py: GPT-2, Llama at batch 8: auto, the folded path forced (cuDNN), the bias path"
        timeout 120 python3 benchmarks/gpu.py --batch 8 --lengths 1024 4096 --repeats 3 --gen-repeats 1 \
            --new-tokens 8 --no-main-job --types gpt2 llama --arms unpatched-flash unpatched-cudnn auto fold-cudnn bias
    } 2>&1 | tee "$OUT/gpu_lease_batch.log"
}

cudnn_steps() {  # gpu.py's training steps at 8 x 1k, 8 x 4k, 1 x 16k: auto and cudnn against the unpatched kernels
    timeout 100 python3 benchmarks/gpu.py --batch 8 --lengths 1024 4096 --repeats 3 --gen-repeats 1 \
        --new-tokens 8 --no-main-job --types gpt2 llama --arms auto cudnn "$@"
    timeout 60 python3 benchmarks/gpu.py --batch 1 --lengths 16384 --repeats 3 --gen-repeats 1 \
        --new-tokens 8 --no-main-job --types gpt2 llama --arms auto cudnn "$@"
}

cudnn() {  # cuDNN's fused ALiBi checked against float64 and timed (carry [".whl/d"], timeout_s 420)
    environment
    install .whl/d/*.whl || echo "wheel install failed: the cudnn arms will say why"
    {
        describe
        python3 -c "import cudnn; print('nvidia-cudnn-frontend', cudnn.__version__, 'cuDNN', cudnn.backend_version())" \
            2>&1 | tail -1
        echo "== pytest -m gpu: cuDNN's fused ALiBi against float64 (tests/core/test_gpu_cudnn.py)"
        timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/core/test_gpu_cudnn.py 2>&1 | tail -25
        echo "== benchmarks/gpu_attention.py: one attention call, forward + backward, no dropout and dropout 0.1"
        for dropout in 0 0.1; do
            timeout 30 python3 benchmarks/gpu_attention.py --batch 8 --lengths 1024 2048 4096 --dropout $dropout \
                --arms plain-cudnn plain-flash plain-efficient fold-cudnn cudnn
            timeout 30 python3 benchmarks/gpu_attention.py --lengths 4096 16384 --dropout $dropout \
                --arms plain-cudnn plain-flash plain-efficient fold-cudnn cudnn
        done
        echo "== benchmarks/gpu.py: GPT-2, Llama training steps at 8 x 1k, 8 x 4k, 1 x 16k, no dropout"
        cudnn_steps
    } 2>&1 | tee "$OUT/gpu_lease_cudnn.log"
}

cudnn_dropout() {  # the same steps with the types' default dropouts (carry [".whl/d"], timeout_s 240)
    environment
    install .whl/d/*.whl || echo "wheel install failed: the cudnn arms will say why"
    {
        describe
        echo "== benchmarks/gpu.py: GPT-2, Llama training steps at 8 x 1k, 8 x 4k, 1 x 16k, default dropouts"
        cudnn_steps --dropout
    } 2>&1 | tee "$OUT/gpu_lease_cudnn_dropout.log"
}

case "${1:-}" in
    prepare) prepare ;;
    part1) part1 ;;
    part2) part2 ;;
    choice) choice ;;
    attention) attention ;;
    attention_fa4) attention_fa4 ;;
    batch) batch ;;
    prepare_cudnn) prepare_cudnn ;;
    cudnn) cudnn ;;
    cudnn_dropout) cudnn_dropout ;;
    *) echo "usage: bash tools/gpu_lease.sh prepare | part1 | part2 | choice | attention | attention_fa4 | batch" \
            "| prepare_cudnn | cudnn | cudnn_dropout"
       echo "(the steps: the comment at its top)"; exit 2 ;;
esac
