"""The tokenizer of a converted folder loads without hf_alibi, without running or being asked to run code.

Why transformers asks (5.x, ``models/auto/tokenization_auto.py``): ``AutoTokenizer.from_pretrained`` first
calls ``AutoConfig.from_pretrained(folder, trust_remote_code=None)`` whenever no ``config=`` is passed. Its
config.json has ``auto_map["AutoConfig"]`` (needed by ``trust_remote_code=True`` for the model) and a
``model_type`` (``alibi_gpt2``) plain transformers does not know, so ``resolve_trust_remote_code`` prompts
before AutoTokenizer falls back to a generic config and reads tokenizer_config.json. Nothing in the folder
can avoid that: the same AutoConfig call serves the model. The model card therefore loads the tokenizer
with ``trust_remote_code=False`` (no prompt, no code), which this test runs as written there.
"""

import re

import pytest
from sharing import TINY_BY_TYPE, last_json_line, make_tokenizer, run_child
from transformers import AutoTokenizer

from hf_alibi import cli

PROMPT = "Do you wish to run the custom code?"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    TINY_BY_TYPE["gpt2"].make().save_pretrained(folder / "src")
    make_tokenizer(folder / "src")
    assert cli.main(["convert", str(folder / "src"), str(folder / "alibi")]) == 0
    return folder


def _card_tokenizer_line(folder) -> str:
    card = (folder / "README.md").read_text()
    lines = [line for line in card.splitlines() if line.startswith("tokenizer = AutoTokenizer.from_pretrained(")]
    assert len(lines) == 1, card
    return lines[0]


def test_the_model_cards_tokenizer_line_loads_without_a_prompt(converted, tmp_path):
    line = _card_tokenizer_line(converted / "alibi")
    assert re.fullmatch(
        r'tokenizer = AutoTokenizer\.from_pretrained\("REPO_OR_FOLDER", trust_remote_code=False\).*', line
    )
    text = "w1 w5 w96 w42"
    expected = AutoTokenizer.from_pretrained(converted / "src")(text)["input_ids"]  # the source's own tokenizer
    assert expected == [1, 5, 96, 42]
    code = f"""
    import json, os, sys
    from transformers import AutoTokenizer
    {line.replace('"REPO_OR_FOLDER"', '"alibi"')}
    print(json.dumps({{"ids": tokenizer({text!r})["input_ids"], "modules": sorted(m for m in sys.modules
          if "modeling_alibi" in m or m.startswith("transformers_modules"))}}))
    """
    result = run_child(code, converted, tmp_path / "hf", block_hf_alibi=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert PROMPT not in result.stdout + result.stderr
    report = last_json_line(result.stdout)
    assert report["ids"] == expected
    assert report["modules"] == []  # no remote code was imported
    assert not (tmp_path / "hf" / "modules").exists() or not any((tmp_path / "hf" / "modules").rglob("*.py"))


def test_without_the_flag_transformers_asks(converted, tmp_path):
    """Why the card passes trust_remote_code=False: if this fails, transformers stopped asking, and the card
    (hf_alibi/hub/card.py) can drop the flag."""
    code = """
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained("alibi")
    print("ids", tokenizer("w1 w5")["input_ids"])
    """
    result = run_child(code, converted, tmp_path / "hf", block_hf_alibi=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert PROMPT in result.stdout  # stdin is closed in the child: the answer is no, then it loads anyway
    assert "ids [1, 5]" in result.stdout
