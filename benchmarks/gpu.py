"""What ALiBi costs on a CUDA GPU in bf16: every hf_alibi kernel against the fastest unpatched backend, one table.

    python benchmarks/gpu.py                        # GPT-2 (and Llama when hf_alibi converts it), L = 1k..16k
    python benchmarks/gpu.py --lengths 1024 4096 --repeats 3 --no-main-job
    python benchmarks/gpu.py --types bloom mpt falcon --lengths 2048   # the models trained with ALiBi
    bash tools/gpu_lease.sh part1                    # on a lent GPU: pytest -m gpu, then this

For each model (a GPT-2 of 12 layers, width 768, 12 heads; a Llama of the same size with 4 KV heads; the native
BLOOM / MPT / Falcon-RW shapes with ``--types``), all in bf16 (weights and activations), and each L: one training step
(forward + backward, no optimizer) time, its peak ``torch.cuda.max_memory_allocated`` above the memory held before the
step, and cached generation tokens/s (a prompt of L tokens, ``--new-tokens`` greedy tokens), for these arms:

- ``unpatched-flash``, ``unpatched-cudnn``, ``unpatched-efficient``: the stock model on ``sdpa`` with SDPA held to one
  kernel (``sdpa_kernel``); which one PyTorch picks by itself depends on the cuDNN version, so the baseline of every
  ratio is the fastest of the three at that length (the lowest step time, the highest tokens/s), named in the table;
- ``auto``: the ALiBi model on ``sdpa`` as a user gets it (the path ``dispatch.choose_path`` picks, nothing forced);
- ``fold-flash``: the ALiBi model on ``sdpa``, the folded path forced (``auto`` takes the bias path at small sizes),
  in the channel construction (``HF_ALIBI_FOLD=channel``: a q/k head of 72, run by SDPA's flash kernel in its 96-wide
  variant); ``fold-cudnn``: the cudnn construction (``HF_ALIBI_FOLD=cudnn``: q/k 72, values 64, cuDNN's attention),
  the one "auto" folds with on CUDA;
- ``fa4``: the ALiBi model on ``flash_attention_4`` (FlashAttention-4 with an ALiBi score_mod), if flash-attn-4 is
  installed;
- ``bias``: the ALiBi model forced onto the bias tensor (``set_attention_path(model, "bias")``);
- ``flex``: the ALiBi model on ``flex_attention`` (``score_mod``, compiled by transformers);
- ``flash``: the ALiBi model on ``flash_attention_2`` (flash-attn's ``alibi_slopes``), if installed;
- ``cudnn``: the ALiBi model on ``cudnn`` (cuDNN's own fused ALiBi, ``set_attn_implementation("cudnn")``), if
  nvidia-cudnn-frontend is installed (``.[cuda]``); it renders no KV cache, so its generation cell shows the refusal.

``--dropout`` builds every model with its type's default dropouts (GPT-2's 0.1, attention dropout included) instead of
none; the unpatched and ALiBi arms then train with the same dropout (an arm without it prints its refusal).

For the native types the unpatched arms are transformers' own implementation (the reference hf_alibi must match).
Arms are timed interleaved (one step of each, repeated), each figure the median of ``--repeats``, after ``--warmup``
steps (flex and FA4 compile there). Ratios are arm / baseline (time and memory: lower is better; tokens/s: higher is
better). An arm that runs out of memory or fails prints its error in the table instead of figures. ``path`` is what
the ALiBi layers recorded (``AlibiBias.last_path``).

Then the main job (``scripts/run_clm.py``, the README's command) with ``--bf16`` on the GPU instead of
``--use_cpu``: its wall-clock time and its perplexity ratios at 2x / 4x / 8x the training length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from builders import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's hf_alibi, not another installed copy
UNPATCHED = ("unpatched-flash", "unpatched-cudnn", "unpatched-efficient")
ARMS = (*UNPATCHED, "auto", "fold-flash", "fold-cudnn", "fa4", "bias", "flex", "flash", "cudnn")
FOLD_ENV = "HF_ALIBI_FOLD"  # hf_alibi.core.folded.FOLD_ENV (read here without importing torch-side code first)


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_func  # noqa: F401  (flash-attn 2; flash-attn-4 ships flash_attn.cute only)
    except ImportError:
        return False
    return True


def _cudnn_frontend_installed() -> bool:
    try:
        import cudnn  # noqa: F401  (NVIDIA's nvidia-cudnn-frontend)
    except ImportError:
        return False
    return True


def _fa4_installed() -> bool:
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Arm:
    """One arm's model and what it runs under (an SDPA kernel held, a fold construction forced)."""

    model: object
    sdpa: str | None = None  # SDPBackend name held for the unpatched arms
    env: dict = field(default_factory=dict)

    @contextmanager
    def running(self):
        saved = {name: os.environ.get(name) for name in self.env}
        os.environ.update(self.env)
        try:
            if self.sdpa is None:
                held = nullcontext()
            else:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                held = sdpa_kernel(getattr(SDPBackend, self.sdpa))
            with held:
                yield self.model
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def build_gpt2(max_len: int, args):
    shape = dict(layers=args.layers, heads=args.heads, width=args.width, positions=max_len, vocab=args.vocab)
    return build_model("gpt2", **shape, dropout=args.dropout)


def build_llama(max_len: int, args):
    shape = dict(layers=args.layers, heads=args.heads, width=args.width, positions=max_len, vocab=args.vocab)
    return build_model(
        "llama", **shape, dropout=args.dropout, num_key_value_heads=max(1, args.heads // 3),
        intermediate_size=int(8 / 3 * args.width) // 64 * 64,
    )  # fmt: skip


def build_native(model_type: str) -> Callable:
    """BLOOM, MPT, Falcon-RW (trained with ALiBi): transformers' own attention (eager; Falcon sdpa) is the baseline."""

    def build(max_len: int, args):
        shape = dict(layers=args.layers, heads=args.heads, width=args.width, positions=max_len, vocab=args.vocab)
        return build_model(model_type, **shape, attn=None, dropout=False)

    return build


BUILDERS: dict[str, Callable] = {"gpt2": build_gpt2, "llama": build_llama}
NATIVE = {name: build_native(name) for name in ("bloom", "mpt", "falcon")}  # --types bloom mpt falcon


def _backend(model, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except (ValueError, ImportError):  # a model transformers has not marked for it: dispatch anyway
        model.config._attn_implementation_internal = name


def make_arm(arm: str, builder: Callable, max_len: int, args):
    """One arm (its model on the GPU in bf16), or a string saying why it cannot run."""
    import hf_alibi

    held = {"unpatched-flash": "FLASH_ATTENTION", "unpatched-cudnn": "CUDNN_ATTENTION"}
    held["unpatched-efficient"] = "EFFICIENT_ATTENTION"
    if arm == "fa4" and not _fa4_installed():
        return "flash-attn-4 not installed"
    if arm == "flash" and not _flash_attn_installed():
        return "flash-attn not installed"
    if arm == "cudnn" and not _cudnn_frontend_installed():
        return "nvidia-cudnn-frontend not installed (.[cuda])"
    model = builder(max_len, args)
    if arm in held:
        model = model.to(device="cuda", dtype=torch.bfloat16)
        own = model.config._attn_implementation
        if own == "sdpa":
            return Arm(model, sdpa=held[arm])
        # a native type whose transformers class runs another backend: that one, as the one unpatched arm
        return Arm(model) if arm == "unpatched-flash" else f"transformers runs {own!r} here, not sdpa"
    hf_alibi.patch_model(model)
    env = {}
    if arm == "bias":
        hf_alibi.set_attention_path(model, "bias")
    elif arm in ("fold-flash", "fold-cudnn"):  # the folded path, forced: "auto" takes the bias path at small sizes
        hf_alibi.set_attention_path(model, "folded")
        env[FOLD_ENV] = "channel" if arm == "fold-flash" else "cudnn"
    elif arm == "flex":
        # hf_alibi registers its FlexAttention function; models off transformers' flex list dispatch too
        model.config._attn_implementation_internal = "flex_attention"
    elif arm == "fa4":
        _backend(model, "flash_attention_4")
    elif arm == "flash":
        _backend(model, "flash_attention_2")
    elif arm == "cudnn":
        model.set_attn_implementation("cudnn")
    return Arm(model.to(device="cuda", dtype=torch.bfloat16), env=env)


def ids(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(length)).cuda()


def paths(model) -> str:
    from hf_alibi.core.bias import AlibiBias

    found = {m.last_path for m in model.modules() if isinstance(m, AlibiBias)}
    return ",".join(sorted(str(p) for p in found)) if found else "-"


def train_step(model, batch: torch.Tensor) -> tuple[float, float]:
    """(ms, peak MB above what was allocated before the step) of one forward + backward."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    model(input_ids=batch, labels=batch).loss.backward()
    end.record()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    model.zero_grad(set_to_none=True)
    return start.elapsed_time(end), peak


def generate_rate(model, prompt: torch.Tensor, new_tokens: int) -> float:
    model.eval()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    torch.cuda.synchronize()
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return new_tokens / (time.perf_counter() - start)


def measure(models: dict, fn: Callable, warmup: int, repeats: int) -> dict:
    """Interleaved: one call per arm, ``repeats`` times; each arm's median, or its error."""
    results: dict = {name: [] for name in models}
    for round_ in range(warmup + repeats):
        for name, arm in models.items():
            if isinstance(results[name], str):
                continue
            try:
                with arm.running() as model:
                    value = fn(model)
            except torch.cuda.OutOfMemoryError:
                results[name] = "OOM"
                torch.cuda.empty_cache()
                continue
            except Exception as error:  # one failing arm must not end the table
                results[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:60]}"
                continue
            if round_ >= warmup:
                results[name].append(value)
    out = {}
    for name, values in results.items():
        if isinstance(values, str):
            out[name] = values
        elif isinstance(values[0], tuple):
            out[name] = tuple(statistics.median(v) for v in zip(*values))
        else:
            out[name] = statistics.median(values)
    return out


def _baseline(results: dict, better: Callable) -> tuple:
    """The best unpatched arm's figures and its name, or ``(None, "none ran")``."""
    ran = {arm: value for arm, value in results.items() if arm in UNPATCHED and not isinstance(value, str)}
    if not ran:
        return None, "none ran"
    best = max(ran, key=lambda arm: better(ran[arm]))
    return ran[best], best


def run_model(model_type: str, args) -> None:
    builder = {**BUILDERS, **NATIVE}[model_type]
    max_len = max(args.lengths) + args.new_tokens
    models, skipped = {}, {}
    for arm in args.arms:
        made = make_arm(arm, builder, max_len, args)
        (skipped if isinstance(made, str) else models)[arm] = made
    for arm, why in skipped.items():
        print(f"| {model_type} | all | {arm} | {why} | | | | | | |", flush=True)
    for length in args.lengths:
        batch = ids(args.batch, length, args.vocab)
        train = measure(models, lambda m, b=batch: train_step(m, b), args.warmup, args.repeats)
        step_paths = {name: paths(arm.model) for name, arm in models.items()}
        prompt = ids(1, length, args.vocab)
        gen = measure(models, lambda m, p=prompt: generate_rate(m, p, args.new_tokens), 1, args.gen_repeats)
        base_t, base_t_arm = _baseline(train, lambda t: -t[0])  # the fastest unpatched backend at this length
        base_g, base_g_arm = _baseline(gen, lambda g: g)
        for arm in models:
            t, g = train[arm], gen[arm]
            if isinstance(t, str):
                time_cells = f"{t} | | | "
            else:
                ratio = f"{t[0] / base_t[0]:.3f}" if base_t else "n/a"
                mem = f"{t[1] / base_t[1]:.3f}" if base_t else "n/a"
                time_cells = f"{t[0]:.1f} | {ratio} | {t[1]:.0f} | {mem}"
            if isinstance(g, str):
                gen_cells = f"{g} | "
            else:
                gen_cells = f"{g:.1f} | " + (f"{g / base_g:.3f}" if base_g else "n/a")
            print(f"| {model_type} | {length} | {arm} | {time_cells} | {gen_cells} | {step_paths[arm]} |", flush=True)
        print(f"| {model_type} | {length} | baseline: train {base_t_arm}, generation {base_g_arm} | | | | | | | |")
    del models
    torch.cuda.empty_cache()


def main_job(args) -> None:
    """The README's main job with --bf16 on the GPU: wall-clock and perplexity ratios."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, os.path.join(ROOT, "scripts", "run_clm.py"), "--model_type", "gpt2", "--alibi",
            "--config_overrides", "n_layer=4,n_embd=128,n_head=4", "--tokenizer_vocab_size", "4096",
            "--block_size", "128", "--per_device_train_batch_size", "16", "--max_steps", "400",
            "--learning_rate", "2e-3", "--warmup_steps", "40", "--lr_scheduler_type", "cosine",
            "--weight_decay", "0.01", "--do_train", "--bf16", "--report_to", "none", "--save_strategy", "no",
            "--logging_steps", "50", "--disable_tqdm", "true", "--eval_lengths", "128,256,512,1024",
            "--max_eval_tokens", "8192", "--output_dir", out,
        ]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            tail = " / ".join(done.stderr.strip().splitlines()[-3:])[:300]
            print(f"| main job (run_clm.py --bf16, CUDA) | failed, exit {done.returncode}: {tail} |")
            return
        with open(os.path.join(out, "eval_results.json")) as f:
            results = json.load(f)
    summary = json.dumps({k: v for k, v in results.items() if k not in ("trainer_eval",)}, sort_keys=True)
    print(f"| main job (run_clm.py --bf16, CUDA) | {seconds:.0f} s wall-clock | eval_results: {summary[:2000]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", nargs="*", type=int, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS)
    parser.add_argument("--types", nargs="*", default=list(BUILDERS), choices=[*BUILDERS, *NATIVE])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gen-repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dropout", action="store_true", help="the types' default dropouts (GPT-2: 0.1)")
    parser.add_argument("--no-main-job", dest="main_job", action="store_false")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False).")
    warnings.filterwarnings("ignore")
    import transformers

    import hf_alibi

    for arm in reversed(UNPATCHED):
        if arm not in args.arms:
            args.arms.insert(0, arm)  # every ratio is against the fastest of them
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"bf16, batch {args.batch}, {args.layers} layers, {args.heads} heads, width {args.width}, "
        f"dropout {'the types defaults' if args.dropout else 'none'}, "
        f"cuDNN {torch.backends.cudnn.version()}, median of {args.repeats} (generation {args.gen_repeats}), "
        f"interleaved; "
        f"hf_alibi from {os.path.dirname(hf_alibi.__file__)}"
    )
    print("| model | L | arm | train step ms | / unpatched | peak MB | / unpatched | gen tok/s | / unpatched | path |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    supported = {*hf_alibi.supported_model_types(), *NATIVE}
    for model_type in args.types:
        if model_type not in supported:
            print(
                f"| {model_type} | not convertible by this hf_alibi (supported_model_types): skipped | | | | | | | | |"
            )
            continue
        run_model(model_type, args)
    if args.main_job:
        main_job(args)


if __name__ == "__main__":
    main()
