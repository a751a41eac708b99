"""README's code blocks run as written, top to bottom, in one fresh folder; what README says plain transformers
answers for a converted folder is what it answers.

The blocks, in README's order (``test_every_block_is_run_or_named_here`` fails when one is added or goes):

- ``pip install torch ...``: not run (installs); ``pip install torch ... run_clm.py``: not run here (the main job,
  minutes: tests/training/test_main_job.py runs it as written in the slow tier, tests/training/test_run_clm.py runs
  it small); ``pip install ... pytest``: not run (the whole default tier: tests/test_docs.py checks it is CI's
  command);
- the quickstart and the pretrained Python blocks: run in one namespace;
- the ``hf-alibi`` block: each line run through the command's ``main()`` in the same folder, exit status 0.

Substitutions, each asserted to be there, so that an edit of README that drops one fails here:

- Python: the Hub id of the pretrained block becomes a tiny Llama saved here (nothing is downloaded), and
  ``torch.compile`` runs with the ``aot_eager`` backend, which traces through AOT autograd as inductor does, without
  inductor's C++ build (20 to 50 s a tiny model on this CPU; none of it is hf_alibi's).
- ``hf-alibi``: the Hub id ``openai-community/gpt2`` becomes a tiny GPT-2 folder with a byte-level BPE tokenizer;
  ``my-llama``, ``my-gpt2`` and ``notes.txt`` (names README uses for the user's own) are made here, tiny;
  ``--max_steps 500`` becomes ``--max_steps 2`` (README gives the time of 500 in words); ``--push-to-hub REPO
  --private`` is dropped and the convert runs (the upload is tests/hub/test_hub.py's, against a stand-in Hub); the
  ``serve`` lines, last in the block, are not run (they serve until stopped: tests/serve/test_serve.py,
  tests/serve/test_vllm.py).

The numbers the blocks make are then checked: the reloaded checkpoint gives the converted model's logits, the
compiled pretrained conversion (sinks, slope scale, retained rotary: README's own compile line) the eager ones, and
each command's folder is what it says.
"""

import json
import re
import shlex

import torch
import transformers
from sharing import REPO_ROOT, run_child
from tiny import tiny_gpt2

from hf_alibi import cli
from hf_alibi.train.data import train_tokenizer

HUB_ID = '"HuggingFaceTB/SmolLM2-135M-Instruct"'
COMPILE = "torch.compile(model, fullgraph=True)"
CLI_SUBSTITUTIONS = {  # README's text -> what runs here
    "openai-community/gpt2": "tiny-gpt2",
    "--max_steps 500": "--max_steps 2",
    " --push-to-hub me/gpt2-alibi --private": "",
}


def readme_blocks() -> list[tuple[str, str]]:
    """README's fenced code blocks as (language, text), in order."""
    return re.findall(r"```(\w+)\n(.*?)```", (REPO_ROOT / "README.md").read_text(), flags=re.S)


def test_every_block_is_run_or_named_here():
    kinds = []
    for language, text in readme_blocks():
        if language == "python":
            kinds.append("python")
        elif text.startswith("hf-alibi "):
            kinds.append("hf-alibi")
        elif "run_clm.py" in text:
            kinds.append("main job")
        elif "pytest" in text:
            kinds.append("tests")
        elif text.startswith("pip install"):
            kinds.append("install")
        else:
            kinds.append(f"unknown {language} block: {text[:60]!r}")
    assert kinds == ["install", "main job", "tests", "python", "python", "hf-alibi"]


def tiny_llama(vocab_size: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32,
        )
    )  # fmt: skip


def cli_lines(block: str) -> list[str]:
    """The block's commands, comments dropped, README's substitutions made (each asserted to be there)."""
    for readme_text in CLI_SUBSTITUTIONS:
        assert readme_text in block, f"README's hf-alibi block no longer says {readme_text!r}: update this test"
    lines = []
    for line in block.strip().splitlines():
        command = line.split("  #", 1)[0].strip()
        for readme_text, here in CLI_SUBSTITUTIONS.items():
            command = command.replace(readme_text, here)
        lines.append(command)
    return lines


def test_readme_blocks_run_top_to_bottom_and_give_what_they_promise(tmp_path, monkeypatch, capsys):
    blocks = [text for language, text in readme_blocks() if language == "python" or text.startswith("hf-alibi ")]
    quickstart, pretrained, commands = blocks
    assert HUB_ID in pretrained and COMPILE in pretrained
    tiny_llama(100).save_pretrained(tmp_path / "tiny-llama")
    pretrained = pretrained.replace(HUB_ID, repr(str(tmp_path / "tiny-llama")))
    pretrained = pretrained.replace(COMPILE, 'torch.compile(model, fullgraph=True, backend="aot_eager")')
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()
    namespace: dict = {}
    exec(compile(quickstart, "README.md (quickstart)", "exec"), namespace)
    ids = torch.randint(0, 100, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the snippet's model was built in training mode (dropout); from_pretrained gives eval
        torch.testing.assert_close(namespace["reloaded"](ids).logits, namespace["model"].eval()(ids).logits)
    exec(compile(pretrained, "README.md (pretrained)", "exec"), namespace)
    model, compiled = namespace["model"], namespace["compiled"]
    assert model.config.to_dict()["alibi"]["sinks"] == 1
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    torch._dynamo.reset()

    # the hf-alibi block: the user's folders, tiny, with a byte-level BPE tokenizer (what export-gguf reads)
    text = "def main(argv):\n    for line in argv:\n        print(line.strip())\n" * 40
    tokenizer = train_tokenizer([text], vocab_size=300)
    for name, made in (("tiny-gpt2", tiny_gpt2(vocab_size=len(tokenizer), n_positions=32)),
                       ("my-gpt2", tiny_gpt2(seed=1, vocab_size=len(tokenizer), n_positions=32)),
                       ("my-llama", tiny_llama(len(tokenizer)))):  # fmt: skip
        made.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    (tmp_path / "notes.txt").write_text(text)
    capsys.readouterr()
    lines = cli_lines(commands)
    served = [line for line in lines if line.startswith("hf-alibi serve ")]  # not run: they serve until stopped
    assert served and lines[-len(served) :] == served  # the block ends with them
    outputs = {}
    for line in lines[: -len(served)]:
        argv = shlex.split(line)
        assert argv[0] == "hf-alibi"
        code = cli.main(argv[1:])
        out, err = capsys.readouterr()
        assert code == 0, f"{line}: exit {code}\n{err}"
        outputs[argv[1] + " " + argv[-1]] = out
    for folder in ("gpt2-alibi", "llama-alibi", "gpt2-recovered", "my-gpt2-alibi"):
        assert json.loads((tmp_path / folder / "config.json").read_text())["model_type"].startswith("alibi_")
    assert (tmp_path / "llama-alibi" / "tokenizer.json").is_file()  # the tokenizer kept
    assert json.loads((tmp_path / "gpt2-recovered" / "recovery.json").read_text())["info"]["steps"] == 2
    assert (tmp_path / "gpt2-alibi.gguf").read_bytes()[:4] == b"GGUF"
    assert outputs["info gpt2-alibi"].startswith("gpt2-alibi: ALiBi checkpoint of gpt2 (AlibiGPT2LMHeadModel)")
    assert_plain_transformers_answers_as_readme_says(tmp_path, len(tokenizer))


MARKER_ADVICE = ("trust_remote_code=True", "pip install -e . in a checkout of hf_alibi", "`import hf_alibi`")


def assert_plain_transformers_answers_as_readme_says(folder, vocab_size: int):
    """In a process that cannot import hf_alibi, on the converted GPT-2 the hf-alibi block wrote: the Auto class
    refuses (asking for trust_remote_code=True), the original class raises the marker, whose advice names steps that
    exist, and the tokenizer (``vocab_size`` tokens) loads as docs/sharing.md says, with the one warning it quotes."""
    result = run_child(
        """
        import json, logging, transformers
        answers = {}
        for loader in ("AutoModelForCausalLM", "GPT2LMHeadModel"):
            try:
                getattr(transformers, loader).from_pretrained("gpt2-alibi")
            except Exception as error:
                answers[loader] = [type(error).__name__, str(error)]
        warnings = []
        handler = logging.Handler()
        handler.emit = lambda record: warnings.append(record.getMessage())
        transformers.utils.logging.get_logger().addHandler(handler)
        tokenizer = transformers.AutoTokenizer.from_pretrained("gpt2-alibi", trust_remote_code=False)
        answers["tokenizer"] = [len(tokenizer), warnings]
        print(json.dumps(answers))
        """,
        cwd=folder,
        hf_home=folder / "hf",
        block_hf_alibi=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.strip().splitlines()[-1].split("[y/N] ")[-1])
    auto_error, auto_text = answers["AutoModelForCausalLM"]
    assert auto_error == "ValueError" and "Please pass the argument `trust_remote_code=True`" in auto_text
    plain_error, plain_text = answers["GPT2LMHeadModel"]
    assert "n_positions" in plain_text and "removed by hf_alibi: this is an ALiBi checkpoint" in plain_text
    assert all(advice in plain_text for advice in MARKER_ADVICE), plain_text
    assert "pip install hf_alibi" not in plain_text  # no package index serves it
    readme = " ".join((REPO_ROOT / "README.md").read_text().split())
    said = readme[readme.index("**Never silently wrong on reload.**") :].split(" - **")[0]
    assert "`AutoModelForCausalLM.from_pretrained(folder)` asks whether to run that code" in said
    assert "raises a validation error on `n_positions` whose text is the marker" in said
    assert plain_error in ("StrictDataclassFieldValidationError", "TypeError", "ValueError")
    # docs/sharing.md quotes the warning the tokenizer's load logs
    sharing = " ".join((REPO_ROOT / "docs" / "sharing.md").read_text().split())
    quoted = re.search(r'logs one warning, "(You are using a model of type `alibi_gpt2`[^"]*)"', sharing).group(1)
    size, warnings = answers["tokenizer"]
    assert size == vocab_size and [w for w in warnings if "You are using a model of type" in w] != []
    assert all(w.startswith(quoted) for w in warnings if "You are using a model of type" in w), (quoted, warnings)
