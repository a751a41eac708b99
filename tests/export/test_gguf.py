"""GGUF export (hf_alibi/export/gguf.py) against llama.cpp itself (PyPI llama-cpp-python, which builds the vendored
llama.cpp): logits of the exported file against transformers' forward of the converted model, greedy tokens
through llama.cpp's KV cache against ``generate``, the tokenizer's ids; refusals write nothing.

Without llama_cpp the llama.cpp tests skip; the refusals and the file's own contents are checked regardless.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from arch_cases import CASES, MAX_LEN
from sharing import run_cli

import hf_alibi
from hf_alibi.export.gguf import GGUFExportError, export_gguf
from hf_alibi.train.data import train_tokenizer

TEXTS = [
    "def add(x, y):\n    return x + y  # sum\n",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café, Größe: 42 € — 日本語 🦙  two  spaces\ttab",
]
# a (power of two) and a (not) head count, grouped KV heads on the Llama-shaped rows
SHAPES = {
    "llama": [dict(), dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2)],
    "mistral": [dict(sliding_window=None)],
    "qwen2": [dict(use_sliding_window=False, sliding_window=None, layer_types=None)],
    "smollm3": [dict()],
    "seed_oss": [dict(attention_bias=True)],
    "ernie4_5": [dict()],
    "phi3": [dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2)],  # fused qkv and gate-up
    "glm": [dict(attention_bias=True)],
    "gpt2": [dict(), dict(n_embd=48, n_head=6)],
}
# refact: 1.8e-7 measured. mpt: llama.cpp's CPU GELU reads an fp16 table, up to 1.2e-4 measured on these logits
# (its max bias 7.5 instead of 8: 6e-3)
TOLERANCE = {"refact": 1e-4, "mpt": 3e-4}


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [text * 3 for text in TEXTS] * 20 + ["import torch\nfor i in range(10):\n    print(i)\n"] * 20
    return train_tokenizer(corpus, vocab_size=300)


def converted(name: str, overrides: dict, tokenizer):
    case = next(c for c in CASES if c.name == name)
    return hf_alibi.patch_model(case.make(vocab_size=len(tokenizer), **overrides))


PARAMS = [(name, i) for name, shapes in SHAPES.items() for i in range(len(shapes))]
IDS = [
    f"{name}-{SHAPES[name][i].get('num_attention_heads', SHAPES[name][i].get('n_head', 4))}heads" for name, i in PARAMS
]


def llama_cpp_model(path: Path, n_ctx: int):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=1,
        type_k=0, type_v=0, flash_attn=False,  # F32 KV cache (GGML_TYPE_F32), no F16 mask
    )  # fmt: skip


@pytest.mark.parametrize(("name", "shape"), PARAMS, ids=IDS)
def test_llama_cpp_logits_and_greedy_tokens_equal_transformers(name, shape, tokenizer, tmp_path):
    model = converted(name, SHAPES[name][shape], tokenizer)
    path = export_gguf(model, tmp_path / "model.gguf", tokenizer=tokenizer)
    arch = "mpt" if name == "gpt2" else "refact"
    llm = llama_cpp_model(path, n_ctx=8 * MAX_LEN)
    generator = torch.Generator().manual_seed(3)
    for length in (64, 4 * MAX_LEN * 2):  # 4x and 8x the tiny configs' original length
        ids = torch.randint(3, len(tokenizer), (1, length), generator=generator)
        with torch.no_grad():
            expected = model(ids).logits[0].numpy()
        llm.reset()
        llm.eval(ids[0].tolist())
        found = np.asarray(llm.scores[:length])
        assert np.abs(found - expected).max() < TOLERANCE[arch], (length, np.abs(found - expected).max())
    prompt = ids[0, :12].tolist()
    with torch.no_grad():
        greedy = model.generate(ids[:, :12], max_new_tokens=20, do_sample=False, min_new_tokens=20,
                                eos_token_id=None, pad_token_id=0)[0, 12:].tolist()  # fmt: skip
    llm.reset()
    tokens = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
        tokens.append(token)
        if len(tokens) == 20:
            break
    assert tokens == greedy


def test_llama_cpp_reads_the_real_tokenizer(tokenizer, tmp_path):
    model = converted("llama", {}, tokenizer)
    llm = llama_cpp_model(export_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer), n_ctx=64)
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tokenizer(text)["input_ids"], text


def test_the_file_carries_the_architecture_tokenizer_and_chat_template(tokenizer, tmp_path):
    import gguf

    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for name, arch in (("llama", "refact"), ("gpt2", "mpt")):
        path = export_gguf(converted(name, {}, tokenizer), tmp_path / f"{name}.gguf", tokenizer=tokenizer)
        fields = gguf.GGUFReader(path).fields
        text = {key: bytes(fields[key].parts[-1]).decode() for key in fields if key.startswith(("general.a", "tok"))}
        assert text["general.architecture"] == arch
        assert text["tokenizer.ggml.model"] == "gpt2" and text["tokenizer.ggml.pre"] == "gpt-2"
        assert text["tokenizer.chat_template"] == tokenizer.chat_template
        assert len(fields["tokenizer.ggml.tokens"].data) == len(tokenizer)
    tokenizer.chat_template = None


@pytest.mark.parametrize(
    ("name", "overrides", "options", "words"),
    [
        ("llama", {}, {"sinks": 1}, "sinks=1"),
        ("llama", {}, {"preset": "pretrained"}, "rotary_max_wavelength"),
        ("gpt2", {}, {"slope_scale": 0.5}, "slope_scale=0.5"),
        ("gpt2", {}, {"preset": "pretrained"}, "position_mean="),
        ("mistral", {}, {}, "sliding-window"),
        ("ernie4_5", {"use_bias": True}, {}, "MLP biases"),
        ("seed_oss", {"attention_out_bias": True}, {}, "o_proj bias"),
        ("qwen3", {}, {}, "'qwen3'"),
        ("gemma", {}, {}, "'gemma'"),
        ("bert", {}, {}, "'bert'"),
    ],
)
def test_what_llama_cpp_cannot_run_is_refused_before_writing(name, overrides, options, words, tokenizer, tmp_path):
    case = next(c for c in CASES if c.name == name)
    model = hf_alibi.patch_model(case.make(vocab_size=len(tokenizer), **overrides), **options)
    out = tmp_path / "model.gguf"
    with pytest.raises(GGUFExportError) as caught:
        export_gguf(model, out, tokenizer=tokenizer)
    assert words in str(caught.value) and "\n" not in str(caught.value)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_folder_without_a_tokenizer_is_refused_before_its_weights_load(tokenizer, tmp_path, capsys, monkeypatch):
    import transformers

    folder = tmp_path / "folder"
    converted("llama", {}, tokenizer).save_pretrained(folder)  # no tokenizer saved beside it

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the tokenizer was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    code, _, err = run_cli("export-gguf", str(folder), str(tmp_path / "m.gguf"), capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "has no tokenizer files" in err
    assert "tokenizer.save_pretrained" in err
    assert not (tmp_path / "m.gguf").exists()


def test_cli_exports_a_converted_folder(tokenizer, tmp_path, capsys):
    import gguf

    model = converted("llama", {}, tokenizer)
    model.save_pretrained(tmp_path / "folder")
    tokenizer.save_pretrained(tmp_path / "folder")
    code, out, err = run_cli("export-gguf", str(tmp_path / "folder"), str(tmp_path / "m.gguf"), "--outtype", "f16",
                             capsys=capsys)  # fmt: skip
    assert code == 0, err
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    code, out, err = run_cli("export-gguf", str(tmp_path / "nowhere"), str(tmp_path / "x.gguf"), capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "hf-alibi: error:" in err
    assert not (tmp_path / "x.gguf").exists()
    # an existing OUT is kept unless --overwrite
    before = (tmp_path / "m.gguf").read_bytes()
    code, out, err = run_cli("export-gguf", str(tmp_path / "folder"), str(tmp_path / "m.gguf"), capsys=capsys)
    assert code == 2 and "--overwrite" in err and err.count("\n") == 1
    assert (tmp_path / "m.gguf").read_bytes() == before
    code, out, err = run_cli("export-gguf", str(tmp_path / "folder"), str(tmp_path / "m.gguf"), "--overwrite",
                             capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert gguf.GGUFReader(tmp_path / "m.gguf").tensors[0].tensor_type.name == "F32"


# bound on |dequantized - weight| relative to the row's largest |weight| (f16: 2^-11; bf16: 2^-8; q8_0: half a step
# of 1/127 of the block's largest, plus its f16 scale), and on llama.cpp's logits against transformers' in f32
# (which also rounds activations to f16 / bf16 / q8_0 in its matrix products): 128 tokens, logits of size ~1
WEIGHT_BOUND = {"f16": 2**-11, "bf16": 2**-8, "q8_0": 0.5 / 127 + 2**-11}
LOGIT_BOUND = {"f16": 2e-3, "bf16": 1e-2, "q8_0": 3e-2}  # measured 3e-4 / 2.7e-3 / 7.6e-3 (llama), 9.7e-3 (gpt2 q8_0)


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize(
    ("name", "overrides"),
    [("llama", dict(hidden_size=64, intermediate_size=96)), ("gpt2", dict(n_embd=64)), ("phi3", dict(hidden_size=48))],
)
def test_outtypes_round_the_matrices_only(name, overrides, outtype, tokenizer, tmp_path):
    import gguf

    model = converted(name, overrides, tokenizer)
    path = export_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer, outtype=outtype)
    written = {t.name: t for t in gguf.GGUFReader(path).tensors}
    kinds = set()
    for tensor_name, tensor in written.items():
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape)))
        if len(tensor.shape) == 1 or tensor.shape[1] == 1:
            assert tensor.tensor_type.name == "F32", tensor_name
            continue
        weight = _weight_of(model, tensor_name, name)
        # rows that are not whole Q8_0 blocks of 32 (phi3's width 48) fall back to f16, as llama.cpp's converter
        expected_kind = {"f16": "F16", "bf16": "BF16", "q8_0": "F16" if weight.shape[-1] % 32 else "Q8_0"}[outtype]
        assert tensor.tensor_type.name == expected_kind, tensor_name
        kinds.add(expected_kind)
        bound = WEIGHT_BOUND["f16" if expected_kind == "F16" else outtype]
        scale = np.abs(weight).max(axis=-1, keepdims=True)
        assert (np.abs(values - weight) <= bound * scale + 1e-12).all(), tensor_name
    assert kinds == ({"F16", "Q8_0"} if name == "phi3" and outtype == "q8_0" else {expected_kind})
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=1,
                          type_k=0, type_v=0, flash_attn=False)  # fmt: skip
    ids = torch.randint(3, len(tokenizer), (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits[0].numpy()
    llm.eval(ids[0].tolist())
    assert np.abs(np.asarray(llm.scores[:128]) - expected).max() < LOGIT_BOUND[outtype]


def _weight_of(model, gguf_name: str, name: str) -> np.ndarray:
    """The model's own matrix behind a GGUF tensor name, (out, in), written here from the architectures' layouts."""
    state = {k: v.detach().float().numpy() for k, v in model.base_model.state_dict().items()}
    if gguf_name in ("token_embd.weight", "output.weight"):
        return state["wte.weight" if name == "gpt2" else "embed_tokens.weight"] if gguf_name[0] == "t" else (
            model.get_output_embeddings().weight.detach().numpy())  # fmt: skip
    _, layer, part, _ = gguf_name.split(".")
    if name == "gpt2":
        conv = {
            "attn_qkv": "attn.c_attn",
            "attn_output": "attn.c_proj",
            "ffn_up": "mlp.c_fc",
            "ffn_down": "mlp.c_proj",
        }
        return state[f"h.{layer}.{conv[part]}.weight"].T
    q = model.config.num_attention_heads * model.config.head_dim
    kv = model.config.num_key_value_heads * model.config.head_dim
    fused = {
        "attn_q": ("self_attn.qkv_proj", slice(0, q)), "attn_k": ("self_attn.qkv_proj", slice(q, q + kv)),
        "attn_v": ("self_attn.qkv_proj", slice(q + kv, None)),
        "ffn_gate": ("mlp.gate_up_proj", slice(0, model.config.intermediate_size)),
        "ffn_up": ("mlp.gate_up_proj", slice(model.config.intermediate_size, None)),
    }  # fmt: skip
    plain = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}  # fmt: skip
    key = f"layers.{layer}.{plain[part]}.weight"
    if key in state:
        return state[key]
    module, rows = fused[part]
    return state[f"layers.{layer}.{module}.weight"][rows]
