"""What a converted folder holds: SRC's companion files (sentence-transformers modules, generation config,
chat template, every tokenizer file), a tokenizer and a config without the original's maximum length."""

import json
import shutil

import pytest
import torch
from sharing import TINY_BY_TYPE, make_tokenizer, run_cli
from tiny import VOCAB
from transformers import AutoTokenizer, BertConfig, BertModel, BertTokenizer, GPT2Config, pipeline
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

import hf_alibi
from hf_alibi import cli
from hf_alibi.convert.positions import original_length
from hf_alibi.core.config import REMOVED_FIELD_MARKER
from hf_alibi.hub import companion_files, copy_companions

ORIGINAL_MAX = 16  # the tiny models' positions
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
SPECIAL = '{"unk_token": "[UNK]", "pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]"}'
# sentence-transformers' files, as all-MiniLM-L6-v2 has them (the Normalize module has no folder there)
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
POOLING = {
    "word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
    "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
}  # fmt: skip
ST_FILES = {
    "modules.json": json.dumps(MODULES),
    "1_Pooling/config.json": json.dumps(POOLING),
    "sentence_bert_config.json": json.dumps({"max_seq_length": ORIGINAL_MAX, "do_lower_case": False}),
    "config_sentence_transformers.json": json.dumps({"__version__": {"sentence_transformers": "2.0.0"}}),
    "data_config.json": "[]",
}
# What the converted folder must not take from SRC: weights, their exports, the original's code, hidden files.
NOT_COMPANIONS = {
    "training_args.bin": b"\x00", "modeling_old.py": b"raise SystemExit", ".hidden": b"x",
    "onnx/model.onnx": b"\x00", "pytorch_model.bin.index.json": b"{}",
}  # fmt: skip


def _words(n: int) -> str:
    return " ".join(f"w{1 + i % 90}" for i in range(n))


def _write(folder, files):
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())


@pytest.fixture(scope="module")
def st_src(tmp_path_factory):
    """A sentence-transformers folder of a tiny BERT with a WordPiece tokenizer (vocab.txt), max length 16."""
    src = tmp_path_factory.mktemp("st_src")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=ORIGINAL_MAX, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    BertModel(config).eval().save_pretrained(src)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(1, VOCAB - 4)]
    (src / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(src / "vocab.txt"), model_max_length=ORIGINAL_MAX).save_pretrained(src)
    _write(src, {**ST_FILES, "special_tokens_map.json": SPECIAL, **NOT_COMPANIONS})
    return src


@pytest.fixture(scope="module")
def st_out(st_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("st_out") / "alibi"
    assert cli.main(["convert", str(st_src), str(out)]) == 0
    return out


def test_companions_are_kept_byte_for_byte(st_src, st_out):
    for name in [*ST_FILES, "vocab.txt", "special_tokens_map.json"]:
        if name != "sentence_bert_config.json":
            assert (st_out / name).read_bytes() == (st_src / name).read_bytes(), name
    for name in NOT_COMPANIONS:
        assert not (st_out / name).exists(), name
    assert not (st_out / "onnx").exists()
    assert companion_files(st_src) == sorted(
        [*ST_FILES, "vocab.txt", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    )


def test_length_limits_are_lifted(st_src, st_out):
    assert json.loads((st_out / "sentence_bert_config.json").read_text()) == {
        "max_seq_length": None, "do_lower_case": False
    }  # fmt: skip
    assert json.loads((st_out / "tokenizer_config.json").read_text())["model_max_length"] == VERY_LARGE_INTEGER
    assert AutoTokenizer.from_pretrained(st_src).model_max_length == ORIGINAL_MAX
    tokenizer = AutoTokenizer.from_pretrained(st_out)
    assert tokenizer.model_max_length == VERY_LARGE_INTEGER
    assert len(tokenizer(_words(40), truncation=True)["input_ids"]) == 42  # [CLS] 40 words [SEP]: nothing cut
    assert len(AutoTokenizer.from_pretrained(st_src)(_words(40), truncation=True)["input_ids"]) == ORIGINAL_MAX

    config = json.loads((st_out / "config.json").read_text())
    assert config["max_position_embeddings"].startswith(REMOVED_FIELD_MARKER)  # plain transformers refuses
    loaded = hf_alibi.models.AlibiBertModel.from_pretrained(st_out).config
    assert loaded.max_position_embeddings == VERY_LARGE_INTEGER  # comparable: min(..., it) works
    assert min(tokenizer.model_max_length, loaded.max_position_embeddings) == VERY_LARGE_INTEGER
    assert original_length(loaded) is None  # not the original's length


def _mean_pooled_reference(src, texts):
    """all-MiniLM's recipe by hand: the converted BERT's last hidden state, masked mean, L2 normalised."""
    model = hf_alibi.patch_model(BertModel.from_pretrained(src)).eval()
    vocab = (src / "vocab.txt").read_text().split("\n")
    rows = []
    for text in texts:
        ids = torch.tensor([[2] + [vocab.index(w) for w in text.split()] + [3]])  # [CLS] ... [SEP]
        with torch.no_grad():
            hidden = model(input_ids=ids).last_hidden_state[0]
        mean = hidden.mean(0)
        rows.append(mean / mean.norm())
    return torch.stack(rows)


def test_sentence_transformers_encodes_past_the_original_maximum(st_src, st_out):
    from sentence_transformers import SentenceTransformer

    texts = [_words(5), _words(40)]  # 42 tokens: past the original 16
    model = SentenceTransformer(str(st_out), trust_remote_code=True, device="cpu")
    assert model.max_seq_length == VERY_LARGE_INTEGER
    assert [type(m).__name__ for m in model] == ["Transformer", "Pooling", "Normalize"]
    embeddings = model.encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(embeddings, _mean_pooled_reference(st_src, texts), rtol=0, atol=2e-5)
    assert SentenceTransformer(str(st_src), device="cpu").max_seq_length == ORIGINAL_MAX  # the original's


def test_feature_extraction_pipeline(st_src, st_out):
    extractor = pipeline("feature-extraction", model=str(st_out), device="cpu")
    features = torch.tensor(extractor(_words(40))[0])  # (42, 32)
    model = hf_alibi.patch_model(BertModel.from_pretrained(st_src)).eval()
    vocab = (st_src / "vocab.txt").read_text().split("\n")
    ids = torch.tensor([[2] + [vocab.index(w) for w in _words(40).split()] + [3]])
    with torch.no_grad():
        torch.testing.assert_close(features, model(input_ids=ids).last_hidden_state[0], rtol=0, atol=2e-5)


# ---------------------------------------------------------------------------------- generation, chat template


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """A tiny GPT-2 with a chat template, a generation config and extra tokenizer files, and its conversion."""
    src = tmp_path_factory.mktemp("chat_src")
    model = TINY_BY_TYPE["gpt2"].make()
    model.generation_config.max_new_tokens = 5
    model.generation_config.do_sample = False
    model.save_pretrained(src)
    make_tokenizer(src)
    tokenizer = AutoTokenizer.from_pretrained(src)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = ORIGINAL_MAX
    tokenizer.save_pretrained(src)
    _write(src, {"merges.txt": "#version: 0.2\n", "added_tokens.json": "{}", "special_tokens_map.json": SPECIAL})
    out = tmp_path_factory.mktemp("chat_out") / "alibi"
    assert cli.main(["convert", str(src), str(out)]) == 0
    return src, out


def test_chat_template_and_generation_config_are_kept(chat_pair):
    src, out = chat_pair
    for name in ("merges.txt", "added_tokens.json", "special_tokens_map.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["max_new_tokens"], generation["do_sample"]) == (5, False)
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    text = AutoTokenizer.from_pretrained(out).apply_chat_template(messages, tokenize=False)
    assert text == "user w1 w2 assistant w3 "  # the template, rendered by hand
    assert text == AutoTokenizer.from_pretrained(src).apply_chat_template(messages, tokenize=False)


def test_text_generation_pipeline_past_the_original_maximum(chat_pair):
    src, out = chat_pair
    prompt = _words(20)  # 20 tokens: past the original 16
    generated = pipeline("text-generation", model=str(out), device="cpu")(prompt, return_full_text=False)
    # greedy decoding by hand with the converted original, no cache: 5 new tokens (generation_config.json)
    reference = hf_alibi.patch_model(TINY_BY_TYPE["gpt2"].make()).eval()  # make() is seeded: the same weights
    reference.load_state_dict(hf_alibi.models.AlibiGPT2LMHeadModel.from_pretrained(out).state_dict())
    ids = torch.tensor([[int(w[1:]) for w in prompt.split()]])  # the word-level vocabulary: "wN" is id N
    for _ in range(5):
        with torch.no_grad():
            ids = torch.cat([ids, reference(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    expected = " ".join("<unk>" if i == 0 else f"w{i}" for i in ids[0, 20:].tolist())
    assert generated[0]["generated_text"].split() == expected.split()


# ------------------------------------------------------------------------------------------- config lengths


def test_converted_configs_answer_no_maximum_and_keep_the_marker(tmp_path):
    model = hf_alibi.patch_model(TINY_BY_TYPE["gpt2"].make())
    assert model.config.n_positions == model.config.max_position_embeddings == VERY_LARGE_INTEGER
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["n_positions"].startswith(REMOVED_FIELD_MARKER)
    with pytest.raises(Exception, match="removed by hf_alibi"):
        GPT2Config.from_pretrained(tmp_path)  # plain GPT-2 refuses the marker
    t5 = hf_alibi.patch_model(TINY_BY_TYPE["t5"].make())
    assert t5.config.relative_attention_num_buckets is None  # not a length: no number to compare


def test_a_reduced_rotary_row_with_original_max_saves(tmp_path):
    """apertus' llama3 rope compares original_max_position_embeddings with max_position_embeddings on save."""
    from arch_cases import CASES

    case = next(case for case in CASES if case.name == "apertus")
    model = hf_alibi.patch_model(case.make())
    model.save_pretrained(tmp_path)  # raised TypeError ('>=' between int and None)
    loaded = type(model).from_pretrained(tmp_path)
    assert loaded.config.rope_parameters["original_max_position_embeddings"] == 8
    assert loaded.config.max_position_embeddings == VERY_LARGE_INTEGER


# -------------------------------------------------------------------------------------------- a Hub SRC


def test_hub_source_downloads_only_its_companions(st_src, tmp_path, monkeypatch):
    """A Hub SRC: its file list, then modules.json / tokenizer_config.json, then only the companions."""
    import huggingface_hub
    import huggingface_hub.constants

    # the online branch, whatever the environment says (HF_HUB_OFFLINE=1 takes the local cache: the test below)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    repo = tmp_path / "repo"  # what the Hub repo holds
    shutil.copytree(st_src, repo)
    _write(repo, {"1_Pooling/model.safetensors": b"\x01", "model-00001-of-00002.safetensors": b"\x00"})
    listed = [p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file()] + [".gitattributes"]
    downloads = []

    def snapshot(repo_id, allow_patterns=None, **kwargs):
        downloads.append((repo_id, allow_patterns))
        return str(repo)  # the Hub's cache folder of the files asked for

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo_id, **kwargs: listed)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    names = copy_companions("someone/st-model", tmp_path / "out")
    expected = sorted(
        [
            *ST_FILES,
            "1_Pooling/model.safetensors",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.txt",
        ]
    )  # fmt: skip  (a module's own weights stay)
    assert downloads == [
        ("someone/st-model", ["modules.json", "tokenizer_config.json"]),
        ("someone/st-model", expected),
    ]
    assert names == expected
    assert (tmp_path / "out" / "1_Pooling" / "model.safetensors").read_bytes() == b"\x01"
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*.*")) == expected


def test_hub_source_offline_reads_only_the_local_cache(st_src, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1: the companions come from the cached snapshot alone; the Hub is never asked."""
    import huggingface_hub
    import huggingface_hub.constants

    repo = tmp_path / "cached"  # the local cache's snapshot of the repo
    shutil.copytree(st_src, repo)
    calls = []

    def snapshot(repo_id, allow_patterns=None, local_files_only=False, **kwargs):
        calls.append((repo_id, allow_patterns, local_files_only))
        return str(repo)

    def no_network(*args, **kwargs):
        raise AssertionError("the Hub was asked for a file list with HF_HUB_OFFLINE=1")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", no_network)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    names = copy_companions("someone/st-model", tmp_path / "out")
    assert calls == [("someone/st-model", None, True)]
    assert "tokenizer.json" in names and "modules.json" in names
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (repo / "tokenizer.json").read_bytes()


def test_info_of_a_converted_sentence_transformer(st_out, capsys):
    code, stdout, _ = run_cli("info", st_out, "--json", capsys=capsys)
    assert code == 0 and json.loads(stdout)["tokenizer"] is True


def test_recover_writes_the_same_folder(chat_pair, tmp_path, capsys):
    """hf-alibi recover writes through the same writer: companions kept, limits lifted, plus recovery.json."""
    src, _ = chat_pair
    generator = torch.Generator().manual_seed(0)
    words = torch.randint(1, VOCAB, (600,), generator=generator).tolist()
    notes = tmp_path / "notes.txt"
    notes.write_text("\n".join(" ".join(f"w{i}" for i in words[j : j + 12]) for j in range(0, 600, 12)))
    out = tmp_path / "recovered"
    argv = ("--train_file", notes, "--max_steps", "1", "--batch_size", "2", "--length", "16")
    code, _, err = run_cli("recover", src, out, *argv, capsys=capsys)
    assert code == 0, err[-2000:]
    for name in ("merges.txt", "added_tokens.json", "special_tokens_map.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 5
    assert AutoTokenizer.from_pretrained(out).model_max_length == VERY_LARGE_INTEGER
    assert (out / "recovery.json").is_file() and (out / "modeling_alibi.py").is_file()
