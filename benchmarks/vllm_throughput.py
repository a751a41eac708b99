"""vLLM serving a converted model: its tokens/s against vLLM on the unconverted original, and against transformers'
continuous batching (what ``hf-alibi serve --continuous-batching`` runs), the same requests on the same machine.

One Llama (grouped-query attention, head size 64), saved twice with the same weights: the original, and converted
by hf_alibi. Arms, each an engine of its own kept alive in a child process and asked for the same workload in turn
(interleaved: each arm once per round; the median of ``--repeats`` rounds after one warm-up round):

- ``vllm-original``: the original on vLLM's own Llama class;
- ``vllm-original-tf``: the original on vLLM's Transformers backend (``model_impl="transformers"``): the converted
  model's backend, so ``vllm-converted`` / ``vllm-original-tf`` is what ALiBi itself costs in vLLM;
- ``vllm-converted``: the converted folder through hf_alibi's plugin (vLLM's kernels with ``alibi_slopes``);
- ``vllm-converted-sinks``: the same conversion with one sink (the pretrained preset's), served through the fold's
  extra query / key channels (hf_alibi/serve/vllm/sinks.py: heads of 64 padded to 80), so ``vllm-converted-sinks`` /
  ``vllm-converted`` is what serving sinks costs;
- ``transformers-cb``: the converted model in transformers' ``generate_batch`` (paged cache, hf_alibi's paged bias),
  run by ``--transformers-python`` (an interpreter whose transformers runs continuous batching).

Tokens/s = generated tokens / wall time of one call for all requests (greedy, ``--new-tokens`` each, no stop token),
fp32, eager (no torch.compile, for every vLLM arm). Run it where ``.[vllm]`` is installed (named so that, run as a
script, it does not stand in for the ``vllm`` package):

    python benchmarks/vllm_throughput.py                  # 4 layers, width 256, 16 requests x 64 new tokens
    python benchmarks/vllm_throughput.py --transformers-python python3   # transformers' arm in another environment
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

import hf_alibi_boot.vllm  # first, here and in the processes vLLM spawns from this file

HERE = os.path.abspath(__file__)
MARK = "@@hf_alibi_bench@@ "  # starts the lines a child answers with
ARMS = ("vllm-original", "vllm-original-tf", "vllm-converted", "vllm-converted-sinks", "transformers-cb")


def save_models(args, root: str) -> dict[str, str]:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    import hf_alibi

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=4 * args.width, num_hidden_layers=args.layers,
        num_attention_heads=args.width // 64, num_key_value_heads=max(1, args.width // 128),
        max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, args.vocab)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<unk>")
    folders = {name: os.path.join(root, name) for name in ("original", "converted", "converted-sinks")}
    model = LlamaForCausalLM(config)
    model.save_pretrained(folders["original"])
    original = model.state_dict()
    hf_alibi.patch_model(model).save_pretrained(folders["converted"])
    model = LlamaForCausalLM(config)
    model.load_state_dict(original)  # the same weights
    hf_alibi.patch_model(model, sinks=1).save_pretrained(folders["converted-sinks"])
    for folder in folders.values():
        tokenizer.save_pretrained(folder)
    return folders


def workload(args) -> list[list[int]]:
    import random

    rng = random.Random(1)
    lengths = [args.prompt // 4 + (args.prompt - args.prompt // 4) * i // max(1, args.requests - 1)
               for i in range(args.requests)]  # fmt: skip
    return [[rng.randrange(3, args.vocab) for _ in range(n)] for n in lengths]


def serve_arm(arm: str, folder: str, args) -> None:
    """A child: load the arm's engine, then time the workload each time a line arrives on stdin."""
    prompts = workload(args)
    if arm == "transformers-cb":
        import torch
        from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

        import hf_alibi  # noqa: F401  (registers the converted classes)

        torch.set_num_threads(args.threads)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        generation = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        pages = -(-args.requests * (args.prompt + args.new_tokens) // 32) + args.requests
        batching = ContinuousBatchingConfig(page_size=32, num_blocks=pages, max_batch_tokens=args.batch_tokens,
                                            max_requests_per_batch=args.requests)  # fmt: skip

        def run() -> int:
            out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
            return sum(len(o.generated_tokens) for o in out.values())
    else:
        from vllm import LLM, SamplingParams

        impl = {"model_impl": "transformers"} if arm == "vllm-original-tf" else {}
        llm = LLM(folder, dtype="float32", enforce_eager=True, max_model_len=args.prompt + args.new_tokens,
                  max_num_seqs=args.requests, max_num_batched_tokens=args.batch_tokens, seed=0,
                  gpu_memory_utilization=0.5, **impl)  # fmt: skip
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        requests = [{"prompt_token_ids": p} for p in prompts]

        def run() -> int:
            llm.reset_prefix_cache()  # every round computes every prompt again
            return sum(len(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False))

    print(MARK + "ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        tokens = run()
        print(MARK + json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256, help="hidden size; heads of 64")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256, help="longest prompt; lengths spread from a quarter of it")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=512, help="tokens per engine step")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--transformers-python", default=sys.executable, help="interpreter of the transformers arm")
    parser.add_argument("--serve-arm", nargs=2, metavar=("ARM", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_arm:
        return serve_arm(*args.serve_arm, args)

    # every engine process hides what cannot load beside torch+cpu (hf_alibi_boot.vllm.environment)
    threads = {"OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": "2"}
    env = hf_alibi_boot.vllm.environment({**os.environ, **threads})
    passed = _plain(sys.argv[1:])
    with tempfile.TemporaryDirectory() as root:
        folders = save_models(args, root)
        children = {}
        for arm in args.arms:
            folder = folders["original" if arm.startswith("vllm-original") else arm.removeprefix("vllm-")]
            folder = folders["converted"] if arm == "transformers-cb" else folder
            python = args.transformers_python if arm == "transformers-cb" else sys.executable
            child = subprocess.Popen([python, HERE, *passed, "--serve-arm", arm, folder], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
            if _answer(child) != "ready":  # one engine at a time: each loads alone
                print(f"{arm}: failed to start (see its output above)", flush=True)
                child.kill()
                continue
            children[arm] = child
        rates: dict[str, list[float]] = {arm: [] for arm in children}
        for round_ in range(args.repeats + 1):
            for arm, child in children.items():
                child.stdin.write("run\n")
                child.stdin.flush()
                result = json.loads(_answer(child))
                if round_:  # round 0 warms up
                    rates[arm].append(result["tokens"] / result["seconds"])
        for child in children.values():
            child.stdin.close()
            child.wait(timeout=120)
    medians = {arm: statistics.median(r) for arm, r in rates.items()}
    shape = f"{args.layers} layers, width {args.width}, {args.requests} requests of {args.prompt // 4}-{args.prompt}"
    print(f"\n{shape} tokens x {args.new_tokens} new, fp32, {args.threads} threads, median of {args.repeats} rounds")
    for arm, median in medians.items():
        print(f"  {arm:18s} {median:8.1f} tokens/s")
    for arm, ref in (("vllm-original-tf", "vllm-original"), ("vllm-converted", "vllm-original-tf"),
                     ("vllm-converted", "vllm-original"), ("vllm-converted-sinks", "vllm-converted"),
                     ("transformers-cb", "vllm-converted")):  # fmt: skip
        if arm in medians and ref in medians:
            print(f"  {arm} / {ref}: {medians[arm] / medians[ref]:.3f}")


def _answer(child: subprocess.Popen) -> str:
    # the child's next answer (engines print their own lines on stdout too); "" when it ended
    for line in child.stdout:
        if line.startswith(MARK):
            return line[len(MARK) :].strip()
        print(line, end="")
    return ""


def _plain(argv: list[str]) -> list[str]:
    # the options given, less --arms and its values and --transformers-python (the child takes its own)
    out, skip = [], False
    for a in argv:
        if a in ("--arms", "--transformers-python"):
            skip = True
            continue
        if skip and not a.startswith("--"):
            continue
        skip = False
        out.append(a)
    return out


if __name__ == "__main__":
    main()
