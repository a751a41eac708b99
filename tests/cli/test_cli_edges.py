"""``hf-alibi convert`` into a place it cannot write, and ``hf-alibi info`` on a learned encoder."""

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
from sharing import TINY_BY_TYPE, run_cli

import hf_alibi


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _one_line_error(err: str, *fragments: str) -> None:
    """The error is the last line of stderr (progress bars of the model loading may come before it)."""
    last = err.rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert last.startswith("hf-alibi: error: ") and err.endswith("\n"), err
    assert "Traceback" not in err
    err = last
    for fragment in fragments:
        assert fragment in err, err


def test_out_inside_a_file(gpt2_src, tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    before = _tree(tmp_path)
    for out in (tmp_path / "a_file" / "alibi", tmp_path / "a_file" / "deeper" / "alibi"):
        code, _, err = run_cli("convert", gpt2_src, out, capsys=capsys)
        assert code == 2
        _one_line_error(err, f"is inside the file {str(tmp_path / 'a_file')!r}", "Pick another OUT")
    assert _tree(tmp_path) == before and (tmp_path / "a_file").read_text() == "not a folder"


def test_out_in_a_place_root_cannot_write(gpt2_src, capsys):
    """sysfs refuses new folders even to root (EPERM): a real read-only place while the tests run as root."""
    sys_root = Path("/sys")
    probe = sys_root / "hf_alibi_probe"
    if not sys_root.is_dir():
        pytest.skip("no /sys on this machine")
    try:
        os.mkdir(probe)
    except OSError:
        pass
    else:
        os.rmdir(probe)
        pytest.skip("/sys is writable here")
    before = sorted(os.listdir(sys_root))
    for out in (sys_root / "hf_alibi_out", sys_root / "hf_alibi_new" / "deeper" / "out"):
        code, _, err = run_cli("convert", gpt2_src, out, capsys=capsys)
        assert code == 2
        _one_line_error(err, f"Could not write OUT {str(out)!r}", "Nothing was written", "pick a folder you can write")
    assert sorted(os.listdir(sys_root)) == before


@pytest.mark.parametrize("where", ["staging-folder", "weights", "final-rename"])
def test_write_failure_leaves_nothing_behind(gpt2_src, tmp_path, capsys, monkeypatch, where):
    """A read-only or full disk, simulated where each write happens: exit code 2, one line, no folder left."""
    out = tmp_path / "new" / "deeper" / "alibi"  # two parent folders that convert has to create
    denied = PermissionError(13, "Permission denied", str(out.parent))
    if where == "staging-folder":

        def refuse(*args, **kwargs):
            raise denied

        monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    elif where == "weights":
        from transformers import modeling_utils

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(modeling_utils, "safe_save_file", disk_full)
    else:
        real_rename = Path.rename

        def refuse_rename(self, target):
            if Path(target) == out:
                raise denied
            return real_rename(self, target)

        monkeypatch.setattr(Path, "rename", refuse_rename)
    before = _tree(tmp_path)
    code, _, err = run_cli("convert", gpt2_src, out, capsys=capsys)
    assert code == 2
    reason = "No space left on device" if where == "weights" else "Permission denied"
    _one_line_error(err, f"Could not write OUT {str(out)!r}: {reason}", "Nothing was written")
    assert _tree(tmp_path) == before  # no staging folder, no OUT, not even the parents convert made


# ------------------------------------------------------------------------------------------ info, learned


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("model_type", ["bert", "t5"])
def test_info_prints_the_learned_slopes(model_type, tmp_path, capsys):
    model = hf_alibi.patch_model(TINY_BY_TYPE[model_type].make(), encoder_variant="learned")
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, hf_alibi.AlibiBias)]
    learned = [(name, module) for name, module in layers if module.kind == "learned"]
    assert len(learned) == 2  # two encoder layers (T5's decoder self-attention is causal, fixed)
    # saved parameters chosen here; what info must print is -sigmoid of each, computed by hand
    raw = {}
    for index, (name, module) in enumerate(learned):
        left = [0.0, 1.0, -1.0, 2.0 + index]
        right = [-3.0, 0.5 * index, 4.0, -0.25]
        with torch.no_grad():
            module.slopes_left.copy_(torch.tensor(left))
            module.slopes_right.copy_(torch.tensor(right))
        raw[name.removesuffix(".alibi")] = (left, right)  # keyed by the attention layer
    model.save_pretrained(tmp_path / "alibi")

    code, stdout, _ = run_cli("info", tmp_path / "alibi", "--json", capsys=capsys)
    assert code == 0
    info = json.loads(stdout)
    assert list(info["learned_slopes"]) == list(raw)  # layer order: 0, 1
    for name, (left, right) in raw.items():
        assert info["learned_slopes"][name]["left"] == pytest.approx([-_sigmoid(p) for p in left], abs=1e-7)
        assert info["learned_slopes"][name]["right"] == pytest.approx([-_sigmoid(p) for p in right], abs=1e-7)
    assert info["learned_slopes"][next(iter(raw))]["left"][0] == pytest.approx(-0.5)

    code, stdout, _ = run_cli("info", tmp_path / "alibi", capsys=capsys)
    assert code == 0
    for name, (left, right) in raw.items():
        expected_left = ", ".join(f"{-_sigmoid(p):.6g}" for p in left)
        expected_right = ", ".join(f"{-_sigmoid(p):.6g}" for p in right)
        assert f"    {name}: {expected_left} | {expected_right}\n" in stdout, stdout
    fixed = ", ".join(f"{s:.6g}" for s in hf_alibi.get_slopes_list(4))
    assert f"  slopes: {fixed}" not in stdout  # the formula's slopes are not what these layers use
    assert "-0.5, -0.731059, -0.268941" in stdout


def test_info_learned_without_slopes_in_the_weights_is_an_error(tmp_path, capsys):
    model = hf_alibi.patch_model(TINY_BY_TYPE["bert"].make(), encoder_variant="learned")
    model.save_pretrained(tmp_path / "alibi")
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "alibi" / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "alibi" not in k}, tmp_path / "alibi" / "model.safetensors")
    code, _, err = run_cli("info", tmp_path / "alibi", capsys=capsys)
    assert code == 2
    _one_line_error(err, "its weights hold no learned slopes", "save it again")


# ------------------------------------------------------------------------------- recover: OUT checked first


@pytest.fixture
def train_file(tmp_path):
    from tiny import VOCAB

    generator = torch.Generator().manual_seed(0)
    words = torch.randint(1, VOCAB, (600,), generator=generator).tolist()
    path = tmp_path / "notes.txt"
    path.write_text("\n".join(" ".join(f"w{i}" for i in words[j : j + 12]) for j in range(0, 600, 12)))
    return path


@pytest.fixture
def no_training(monkeypatch):
    """Fails the test if recover gets as far as loading the teacher or distilling."""
    import hf_alibi.recover.api as api
    import hf_alibi.recover.checkpoint as job

    def refuse(*args, **kwargs):
        raise AssertionError("recover loaded or trained although OUT cannot be written")

    monkeypatch.setattr(api, "recover", refuse)  # where recover_checkpoint takes it from when it runs
    monkeypatch.setattr(job.AutoTokenizer, "from_pretrained", refuse)


def test_recover_out_in_a_place_root_cannot_write(gpt2_src, train_file, capsys, no_training):
    """Like convert: one line and exit 2 at once, before the tokenizer, the model or a training step."""
    sys_root = Path("/sys")
    if not (sys_root / "kernel").is_dir():
        pytest.skip("no /sys/kernel on this machine")
    try:
        os.mkdir(sys_root / "hf_alibi_probe")
    except OSError:
        pass
    else:
        os.rmdir(sys_root / "hf_alibi_probe")
        pytest.skip("/sys is writable here")
    before = sorted(os.listdir(sys_root))
    for out in (sys_root / "kernel" / "hf_alibi_out", sys_root / "hf_alibi_new" / "deeper" / "out"):
        code, stdout, err = run_cli("recover", gpt2_src, out, "--train_file", train_file, capsys=capsys)
        assert code == 2
        _one_line_error(err, f"Could not write OUT {str(out)!r}", "Nothing was written", "pick a folder you can write")
        assert "[recover]" not in stdout + err
    assert sorted(os.listdir(sys_root)) == before


def test_recover_staging_refused_leaves_nothing(gpt2_src, train_file, tmp_path, capsys, monkeypatch, no_training):
    out = tmp_path / "new" / "deeper" / "recovered"

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(out.parent))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    before = _tree(tmp_path)
    code, _, err = run_cli("recover", gpt2_src, out, "--train_file", train_file, capsys=capsys)
    assert code == 2
    _one_line_error(err, f"Could not write OUT {str(out)!r}: Permission denied", "Nothing was written")
    assert _tree(tmp_path) == before


def test_recover_final_rename_refused_leaves_nothing(gpt2_src, train_file, tmp_path, capsys, monkeypatch):
    """The OSError at the very end (after training): the same one line, no staging folder, no OUT."""
    out = tmp_path / "new" / "recovered"
    real_rename = Path.rename

    def refuse_rename(self, target):
        if Path(target) == out:
            raise PermissionError(13, "Permission denied", str(out.parent))
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", refuse_rename)
    before = _tree(tmp_path)
    argv = ("--train_file", train_file, "--max_steps", "1", "--batch_size", "2", "--length", "16")
    code, _, err = run_cli("recover", gpt2_src, out, *argv, capsys=capsys)
    assert code == 2
    _one_line_error(err, f"Could not write OUT {str(out)!r}: Permission denied", "Nothing was written")
    assert _tree(tmp_path) == before


def test_a_source_that_is_neither_folder_nor_hub_id(tmp_path, capsys):
    for command in (("convert",), ("info",)):
        argv = (*command, "no such/model name") + ((tmp_path / "out",) if command == ("convert",) else ())
        code, _, err = run_cli(*argv, capsys=capsys)
        assert code == 2
        _one_line_error(err, "'no such/model name' is neither a folder nor a valid Hub id")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------- convert: every argument checked first


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if convert gets as far as loading a model."""
    from transformers import modeling_utils

    def refuse(*args, **kwargs):
        raise AssertionError("convert loaded the model although an argument is bad")

    monkeypatch.setattr(modeling_utils.PreTrainedModel, "from_pretrained", classmethod(refuse))


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--heads", "0"), "argument --heads: invalid positive integer value: '0'"),
        (("--heads", "x"), "argument --heads: invalid positive integer value: 'x'"),
        (("--heads", "3"), "--heads 3 does not match SRC's 4 attention heads"),
        (("--encoder-variant", "learned"), "applies to bidirectional attention only"),
        (("--encoder-variant", "sideways"), "argument --encoder-variant/--encoder_variant: invalid choice"),
        (("--preset", "fast"), "argument --preset: invalid choice: 'fast'"),
        (("--sinks", "-1"), "sinks must be an integer >= 0"),
        (("--sinks", "two"), "argument --sinks: invalid int value: 'two'"),
        (("--slope-scale", "0"), "slope_scale must be a finite number > 0"),
        (("--slope-scale", "nan"), "slope_scale must be a finite number > 0"),
        (("--slopes", "0.5,0.25"), "slopes must list one slope per head: 4 numbers, got 2"),
        (("--slopes", "0.5,a,1,1"), "argument --slopes: invalid comma-separated slopes value: '0.5,a,1,1'"),
        (("--slopes", "1,1,1,-1"), "slopes must be finite numbers > 0"),
        (("--slopes", "1,1,1,1", "--slope-scale", "2"), "Pass either slopes or slope_scale, not both"),
        (("--rotary-max-wavelength", "100"), "rotary_max_wavelength applies to rotary models only"),
        (("--private",), "--private apply to the upload only: pass --push-to-hub REPO_ID too"),
        (("--commit-message", "m"), "--commit-message apply to the upload only"),
        (("--push-to-hub", "me/bad name"), "--push-to-hub 'me/bad name' is not a valid Hub repo id"),
    ],
)
def test_every_convert_argument_is_checked_before_loading(gpt2_src, tmp_path, capsys, no_loading, argv, message):
    out = tmp_path / "out"
    code, stdout, err = run_cli("convert", gpt2_src, out, *argv, capsys=capsys)
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1, err  # one line, no usage block
    _one_line_error(err, message)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_preset_options_reach_patch_model_and_info_shows_them(tmp_path, capsys):
    """A tiny Llama (max_position_embeddings 16): the preset's values, one overridden, in config.json and info."""
    src = tmp_path / "llama"
    TINY_BY_TYPE["llama"].make().save_pretrained(src)
    out = tmp_path / "alibi"
    code, _, err = run_cli("convert", src, out, "--preset", "pretrained", "--sinks", "2", capsys=capsys)
    assert code == 0, err
    settings = json.loads((out / "config.json").read_text())["alibi"]
    # PRESETS["pretrained"]: sinks 1 (here 2), rotary kept up to 1024 x the original length (16), slopes x 0.01
    assert (settings["sinks"], settings["rotary_max_wavelength"], settings["slope_scale"]) == (2, 16384.0, 0.01)
    assert settings["slopes"] is None
    code, stdout, _ = run_cli("info", out, "--json", capsys=capsys)
    info = json.loads(stdout)
    assert (info["sinks"], info["rotary_max_wavelength"], info["slope_scale"], info["slopes_given"]) == (
        2,
        16384.0,
        0.01,
        None,
    )
    assert info["slopes"] == pytest.approx([0.01 * 2 ** (-8 * (h + 1) / 4) for h in range(4)])  # the paper's x 0.01
    code, stdout, _ = run_cli("info", out, capsys=capsys)
    stretch = settings["rotary_stretch"]  # PRESETS["pretrained"]'s, past the knee at the original length (16)
    assert settings["rotary_knee"] == 16.0 and stretch > 1
    assert (
        f"  sinks: 2; slopes: the paper's x 0.01; rotary frequencies: kept up to wavelength 16384; rotary wavelengths "
        f"> 16 turn {stretch:g}x slower past position 16\n"
    ) in stdout

    # options that need the preset's rotary_knee take it: the flags override the preset, the knee stays 16
    overrides = (
        (["--rotary-stretch", "3"], 3.0, 1.0),
        (["--rotary-stretch", "1", "--rotary-interpolation", "1.5"], 1.0, 1.5),
    )
    for flags, stretch, interpolation in overrides:
        out1 = tmp_path / f"alibi-{stretch}-{interpolation}"
        code, _, err = run_cli("convert", src, out1, "--preset", "pretrained", *flags, capsys=capsys)
        assert code == 0, err
        settings = json.loads((out1 / "config.json").read_text())["alibi"]
        assert (settings["rotary_knee"], settings["rotary_stretch"], settings["rotary_interpolation"]) == (
            16.0, stretch, interpolation
        )  # fmt: skip
    # without a preset there is no knee to slow past: one line, nothing written
    code, stdout, err = run_cli("convert", src, tmp_path / "no-knee", "--rotary-interpolation", "1.5", capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "give rotary_knee" in err and not (tmp_path / "no-knee").exists()

    out2 = tmp_path / "alibi2"
    code, _, err = run_cli("convert", src, out2, "--slopes", "0.5,0.25,0.125,1", "--rotary-max-wavelength", "8",
                           capsys=capsys)  # fmt: skip
    assert code == 0, err
    code, stdout, _ = run_cli("info", out2, "--json", capsys=capsys)
    info = json.loads(stdout)
    assert info["slopes"] == info["slopes_given"] == [0.5, 0.25, 0.125, 1.0]
    assert (info["sinks"], info["rotary_max_wavelength"], info["slope_scale"]) == (0, 8.0, 1.0)
    code, stdout, _ = run_cli("info", out2, capsys=capsys)
    assert "  slopes: 0.5, 0.25, 0.125, 1\n" in stdout
    assert "  sinks: 0; slopes: explicit (--slopes); rotary frequencies: kept up to wavelength 8\n" in stdout


# ------------------------------------------------------------------ a name that is no folder: no waiting


@pytest.fixture
def hub_download_fails_the_test(monkeypatch):
    """transformers' config download (which retries for half a minute offline) must never be reached."""
    from transformers import PretrainedConfig

    def refuse(*args, **kwargs):
        raise AssertionError("the Hub download was reached")

    monkeypatch.setattr(PretrainedConfig, "get_config_dict", classmethod(refuse))


def test_a_bare_name_that_is_no_folder_fails_at_once_without_network(
    tmp_path, capsys, monkeypatch, hub_download_fails_the_test
):
    import huggingface_hub
    import huggingface_hub.constants
    from huggingface_hub.errors import RepositoryNotFoundError

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    calls = []

    def no_network(url, timeout=None, **kwargs):
        calls.append((url, timeout))
        raise ConnectionError("[Errno -2] Name or service not known")  # as httpx's ConnectError says it

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", no_network)
    monkeypatch.chdir(tmp_path)
    for argv in (("info", "does-not-exist"), ("convert", "does-not-exist", tmp_path / "out")):
        code, _, err = run_cli(*argv, capsys=capsys)
        assert code == 2
        _one_line_error(err, "'does-not-exist' is no folder here, and the Hugging Face Hub could not be reached",
                        "./does-not-exist")  # fmt: skip
    assert calls == [("https://huggingface.co/does-not-exist/resolve/main/config.json", 10)] * 2  # once, no retry

    def not_on_the_hub(url, timeout=None, **kwargs):
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # built without an HTTP response
        Exception.__init__(error, "404 Client Error: Repository Not Found")
        raise error

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", not_on_the_hub)
    code, _, err = run_cli("info", "does-not-exist", capsys=capsys)
    assert code == 2
    _one_line_error(err, "'does-not-exist' is no folder here, and no model on the Hugging Face Hub")
    assert not (tmp_path / "out").exists()


def test_offline_never_reaches_the_network(tmp_path, capsys, monkeypatch, hub_download_fails_the_test):
    import huggingface_hub
    import huggingface_hub.constants

    def refuse(*args, **kwargs):
        raise AssertionError("the network was reached with HF_HUB_OFFLINE=1")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", refuse)
    monkeypatch.chdir(tmp_path)
    for argv in (("info", "does-not-exist"), ("convert", "someone/model", tmp_path / "out")):
        code, _, err = run_cli(*argv, capsys=capsys)
        assert code == 2
        _one_line_error(err, "HF_HUB_OFFLINE is set and it is not in the local cache")


# ------------------------------------------------------------------- recover: every setting checked first


@pytest.fixture
def src32(tmp_path):
    """A tiny GPT-2 of 32 positions with a tokenizer."""
    from sharing import make_tokenizer
    from tiny import tiny_gpt2

    src = tmp_path / "src32"
    tiny_gpt2(n_positions=32).save_pretrained(src)
    make_tokenizer(src)
    return src


@pytest.fixture
def no_recover_loading(monkeypatch, no_training):
    """Fails the test if recover loads the model (on top of the tokenizer and the training)."""
    from hf_alibi.hub.checkpoints import Source

    def refuse(source):
        raise AssertionError("recover picked a model class to load although a setting is bad")

    monkeypatch.setattr(Source, "model_class", refuse)


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (("--length", "64"), ("length 64 is longer than the original model's 32 positions", "--length 32 or less")),
        (("--length", "0"), ("length must be an integer >= 1, got 0",)),
        (("--length", "-5"), ("length must be an integer >= 1, got -5",)),
        (("--learning_rate", "-1"), ("learning_rate must be a finite number > 0, got -1.0",)),
        (("--learning_rate", "nan"), ("learning_rate must be a finite number > 0, got nan",)),
        (("--max_steps", "0"), ("max_steps must be an integer >= 1, got 0",)),
        (("--batch_size", "-2"), ("batch_size must be an integer >= 1, got -2",)),
        (("--lm_weight", "1.5"), ("lm_weight must be between 0 and 1",)),
        (("--temperature", "0"), ("temperature must be a finite number > 0, got 0.0",)),
        (("--lora_rank", "-1"), ("lora_rank must be an integer >= 0, got -1",)),
        (("--save_steps", "0"), ("save_steps must be an integer >= 1, got 0",)),
        (("--preset", "nope"), ("Unknown preset 'nope'", "'pretrained'")),
        (("--length", "16", "--max_eval_length", "8"), ("max_eval_length 8 is shorter than the training length 16",)),
        (("--resume_from_checkpoint", "nowhere"), ("--resume_from_checkpoint 'nowhere' is neither",)),
    ],
)
def test_recover_bad_settings_before_anything_loads(
    src32, train_file, tmp_path, capsys, no_recover_loading, argv, fragments
):
    """Each bad setting is one line and exit 2, before the tokenizer or the model loads
    (the teacher's 32 positions come from config.json), and nothing is written."""
    out = tmp_path / "out"
    before = _tree(tmp_path)
    code, stdout, err = run_cli("recover", src32, out, "--train_file", train_file, *argv, capsys=capsys)
    assert code == 2
    _one_line_error(err, *fragments)
    assert "[recover]" not in stdout + err and _tree(tmp_path) == before
