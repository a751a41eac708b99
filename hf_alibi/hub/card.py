"""The model card (README.md) of an ALiBi checkpoint: the Hub's metadata header, how to load it, the settings."""

from __future__ import annotations

import os
from pathlib import Path

from ..core.config import get_settings
from ..core.settings import conversion_options
from ..core.version import __version__
from .checkpoints import is_hub_id
from .compat import name_or_path
from .remote_code import REMOTE_CODE_FILE, auto_classes_for

# Auto class -> the Hub's pipeline tag, for the model card (first match wins).
PIPELINE_TAGS = {
    "AutoModelForCausalLM": "text-generation",
    "AutoModelForSeq2SeqLM": "text2text-generation",
    "AutoModelForMaskedLM": "fill-mask",
}


def model_card(
    config, base_model: str | None = None, tags: list[str] | None = None, recovery: str | None = None
) -> str:
    """README.md for an ALiBi checkpoint: the Hub's metadata header, how to load it, the settings.

    ``base_model`` is the Hub id the checkpoint was converted from; by default where the config was loaded from
    (``compat.name_or_path``) when it looks like a Hub id (a local path is left out of the header). ``recovery``:
    the section that says how the checkpoint was recovered (:func:`hf_alibi.recover.recovery_card_section`),
    for a recovered one. What the card says about training follows from the settings (:func:`training_note`).
    """
    from huggingface_hub import ModelCardData

    settings = get_settings(config)
    if base_model is None:
        candidate = name_or_path(config)
        base_model = candidate if is_hub_id(candidate) else None
    auto_classes = auto_classes_for(settings.base_model_type)
    arch = (getattr(config, "architectures", None) or [None])[0]
    auto_name = next((a for a, c in auto_classes.items() if arch and "Alibi" + c == arch), "AutoModel")
    pipeline_tag = next((tag for a, tag in PIPELINE_TAGS.items() if a == auto_name), None)
    all_tags = ["alibi", "hf_alibi", settings.base_model_type]
    all_tags += [tag for tag in tags or [] if tag not in all_tags]
    data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        tags=all_tags,
        pipeline_tag=pipeline_tag,
    )
    settings_rows = "\n".join(f"| `{key}` | `{value}` |" for key, value in settings.to_dict().items())
    used = settings.slopes_in_use()
    slopes = "; ".join(
        ", ".join(f"{s:.6g}" for s in layer) for layer in (used if used and isinstance(used[0], list) else [used])
    )
    slopes_scope = "layer by layer, head by head" if used and isinstance(used[0], list) else "head by head"
    origin = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a transformers model"
    bias = (
        "causal: each head adds `-m_h * (i - j)` to the score of query `i` and key `j <= i`"
        if settings.encoder_variant is None
        else f"`{settings.encoder_variant}` bidirectional variant (causal self-attention, if any, stays causal)"
    )
    return f"""---
{data.to_yaml()}
---

# ALiBi {settings.base_model_type}

This checkpoint is {origin} converted to ALiBi (Press, Smith and Lewis, *Train Short, Test Long*, 2021)
by hf_alibi {__version__}: its position embeddings are gone (or cut to
the parts the note below names), and every self-attention layer adds a fixed, head-specific linear penalty
to its attention scores ({bias}), so it runs on inputs longer than it was trained on.
Cross-attention has no position bias.

{training_note(settings, recovered=recovery is not None)}

## How to load

With hf_alibi installed (from its source: `pip install -e .` in a checkout of hf_alibi):

```python
import hf_alibi  # registers the ALiBi model types
from transformers import {auto_name}

model = {auto_name}.from_pretrained("REPO_OR_FOLDER")
```

Without hf_alibi, with the code stored in this repository (`{REMOTE_CODE_FILE.name}`, torch and
transformers only; read it before you trust it):

```python
from transformers import AutoTokenizer, {auto_name}

model = {auto_name}.from_pretrained("REPO_OR_FOLDER", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("REPO_OR_FOLDER", trust_remote_code=False)  # runs no custom code
```

(The tokenizer needs no custom code, but without `trust_remote_code=False` transformers reads config.json
first and asks whether to run the code its `auto_map` names. With it, transformers logs "You are using a model of
type `alibi_...` to instantiate a model of type ``": refused the code, it reads config.json as a generic config
before it reads the tokenizer's own files, which load as saved.)

Loading it with neither fails with an error: plain transformers never rebuilds it as the original
architecture with fresh position embeddings.

## Conversion settings

| setting | value |
|---|---|
{settings_rows}

Slopes `m_h` in use, {slopes_scope}: {slopes}.
{recovery or ""}"""


def training_note(settings, recovered: bool = False) -> str:
    """What the card says about training, from the settings: true for every preset and option.

    >>> training_note(AlibiSettings("gpt2", 4)).startswith("Note: converting does not train.")
    True
    """
    if recovered:
        return "Note: this checkpoint was recovered after conversion (see *Recovery* below)."
    # the options that differ from the paper's, each as its declaration says it (hf-alibi info's words)
    changed = [f for f in conversion_options() if getattr(settings, f.name) != f.default]
    kept = [text for f in changed if (text := f.metadata["describe"](settings))]
    if not kept:
        return (
            "Note: converting does not train. With the paper's settings the position path is simply removed: a "
            "pretrained model converted this way, and not trained since, must be fine-tuned (or recovered with "
            "`hf-alibi recover`) before its outputs are useful, because its weights were learned with position "
            "embeddings."
        )
    return (
        f"Note: converting does not train. These settings keep part of what the pretrained weights learned about "
        f"order ({'; '.join(kept)}), so a pretrained model converted this way runs without training; how close "
        "its outputs stay to the original's depends on the model, the settings and the length (hf_alibi's "
        "docs/pretrained.md has measurements). Compare it with the original on your text; recovery "
        "(`hf-alibi recover`) or fine-tuning narrows the gap."
    )


def write_model_card(
    folder: str | os.PathLike,
    config,
    base_model: str | None = None,
    overwrite: bool = False,
    recovery: str | None = None,
) -> bool:
    """Write README.md into ``folder`` unless one is there (or ``overwrite``). True when written."""
    path = Path(folder) / "README.md"
    if path.exists() and not overwrite:
        return False
    path.write_text(model_card(config, base_model=base_model, recovery=recovery))
    return True
