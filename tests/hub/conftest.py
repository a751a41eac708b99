"""Fixtures of the CLI tests."""

import pytest
from sharing import TINY_BY_TYPE, make_tokenizer


@pytest.fixture
def gpt2_src(tmp_path):
    """An unpatched tiny GPT-2 checkpoint with a tokenizer, as a user would have it on disk."""
    src = tmp_path / "src"
    TINY_BY_TYPE["gpt2"].make().save_pretrained(src)
    make_tokenizer(src)
    return src
