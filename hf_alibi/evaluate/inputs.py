"""What ``compare`` checks before any model loads, each with one line that says what to do (:class:`CompareError`).

Imports only the standard library and hf_alibi's modules that import neither torch nor transformers: the command line
asks :func:`check_configs` before the library is imported (tests/cli/test_cli_startup.py);
:func:`hf_alibi.evaluate.comparison.compare` asks the same again, then the rest (the tokenizers, the text's length, the
output folder) once the tokenizers are read.

Example:
    >>> check_configs({"a": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 97}})
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# the class-name endings of transformers' causal LM heads (LlamaForCausalLM, GPT2LMHeadModel, AlibiGPT2LMHeadModel)
CAUSAL_ENDINGS = ("ForCausalLM", "LMHeadModel")
RESULTS_FILE, PLOT_FILE = "compare.json", "compare.png"
# compare's defaults (the command line's too: read here without torch)
DEFAULT_LENGTHS = (256, 1024, 4096)
DEFAULT_MAX_TOKENS = 4096
DEPTHS = (0.1, 0.5, 0.9)  # where the passkey hides, as a fraction of the filler


class CompareError(ValueError):
    """A bad input to ``compare``: one line saying what to do; raised before any model loads, nothing written."""


# transformers' rope types that stretch a rotary model past its length by a factor, no training (``--rope``)
ROPE_TYPES = ("yarn", "linear", "dynamic")


def parse_rope(spec: str) -> tuple[str, float]:
    """``--rope TYPE:FACTOR`` (``yarn:2``) as ``(type, factor)``: the first model, run with transformers'
    ``rope_parameters`` of that type and factor, is one more row of the comparison.

    >>> parse_rope("yarn:2")
    ('yarn', 2.0)
    """
    kind, _, factor = str(spec).partition(":")
    try:
        value = float(factor)
    except ValueError:
        value = 0.0
    if kind not in ROPE_TYPES or not 1.0 < value < float("inf"):
        raise CompareError(
            f"--rope {spec!r}: give TYPE:FACTOR with TYPE one of {', '.join(ROPE_TYPES)} and FACTOR > 1, e.g. yarn:2."
        )
    return kind, value


def rope_label(kind: str, factor: float) -> str:
    """How a ``--rope`` row is named after its model: ``"yarn x2"``."""
    return f"{kind} x{factor:g}"


def is_causal_lm(config: Mapping[str, Any]) -> bool | None:
    """Whether config.json's ``architectures`` name a causal LM head; None when it names none (the library then asks
    transformers' causal LM mapping by ``model_type``)."""
    names = config.get("architectures") or []
    if not names:
        return None
    return any(str(name).endswith(CAUSAL_ENDINGS) for name in names)


def check_configs(configs: Mapping[str, Mapping[str, Any]]) -> None:
    """Each model a causal LM (by its config.json), and every model the same vocabulary size; a
    :class:`CompareError` naming the model otherwise.

    >>> check_configs({"bert": {"model_type": "bert", "architectures": ["BertForMaskedLM"]}})
    CompareError: MODEL 'bert' is not a causal LM (config.json: BertForMaskedLM) ...
    """
    for name, config in configs.items():
        if is_causal_lm(config) is False:
            raise CompareError(
                f"MODEL {name!r} is not a causal LM (config.json: {', '.join(config['architectures'])}); compare "
                "measures next-token perplexity: pass causal LM folders or Hub ids (a ...ForCausalLM)."
            )
    sizes = {name: config.get("vocab_size") for name, config in configs.items()}
    if len({size for size in sizes.values() if size is not None}) > 1:
        listed = ", ".join(f"{name!r} {size}" for name, size in sizes.items())
        raise CompareError(
            f"the models' vocabularies differ (vocab_size: {listed}): compare scores every model on the same tokens; "
            "pass models that share one tokenizer (an original and its conversions)."
        )


def local_configs(models: Sequence[str]) -> dict[str, dict[str, Any]]:
    """config.json of each model that is a folder here (read as JSON, no transformers); Hub ids are the library's."""
    from ..hub.checkpoints import check_source, is_local

    configs = {}
    for name in models:
        check_source(name, "MODEL")
        if is_local(name):
            configs[name] = json.loads((Path(name).expanduser() / "config.json").read_text())
    return configs


def check_output_folder(out: str | os.PathLike, overwrite: bool) -> Path:
    """``out`` may receive compare.json and compare.png: not a file, and without them unless ``overwrite``."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise CompareError(f"--out {str(out)!r} is a file: pass a folder for {RESULTS_FILE} and {PLOT_FILE}.")
    written = [name for name in (RESULTS_FILE, PLOT_FILE) if (out / name).exists()]
    if written and not overwrite:
        raise CompareError(
            f"--out {str(out)!r} already holds {' and '.join(written)}: pass --overwrite, or another --out."
        )
    return out


def check_lengths(
    tokens: int,
    lengths: Sequence[int],
    max_tokens: int,
    stream: int,
    passkey_lengths: Sequence[int],
    prompt_tokens: int,
    source: str,
) -> None:
    """The text holds enough tokens for the longest length and the stream (the stream's length as asked: compare
    shortens its default one to the text first), and each measure fits its bounds."""
    for length in lengths:
        if length < 2:
            raise CompareError(f"--lengths {length}: a window needs at least 2 tokens; pass lengths >= 2.")
    longest = max(lengths, default=0)
    if longest > max_tokens:
        raise CompareError(
            f"--lengths {longest} is longer than --max-tokens {max_tokens} (the tokens each length's windows cover): "
            f"raise --max-tokens to {longest} or more, or drop the length."
        )
    need = max(longest, stream) + 1
    if tokens < need:
        why = f"the longest length {longest}" if longest >= stream else f"the position stream of {stream} tokens"
        raise CompareError(
            f"the text ({source}) has {tokens} tokens; {why} needs {need}: give a longer text, or lower --lengths / "
            "--position-tokens."
        )
    for length in passkey_lengths:
        if length < prompt_tokens:
            raise CompareError(
                f"--passkey-lengths {length} is too short for the passkey prompt ({prompt_tokens} tokens): "
                "pass longer lengths."
            )


def differing_tokenizers(vocabularies: Mapping[str, Mapping[str, int]]) -> list[str]:
    """The models whose tokenizer's vocabulary is not the first model's (empty: all the same)."""
    names = list(vocabularies)
    first = vocabularies[names[0]] if names else {}
    return [name for name in names[1:] if vocabularies[name] != first]


def tokenizer_refusal(first: str, differ: Sequence[str]) -> CompareError:
    return CompareError(
        f"the tokenizers of {', '.join(repr(n) for n in differ)} differ from {first!r}'s: compare scores every model "
        "on the same tokens; pass models that share one tokenizer (an original and its conversions)."
    )
