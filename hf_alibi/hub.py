"""Sharing converted checkpoints: remote code, ``auto_map``, the model card and the Hub upload.

Every folder an ALiBi model is saved to (``save_pretrained``, ``push_to_hub``, ``hf-alibi convert``)
also gets:

* ``modeling_alibi.py`` and the modules it imports: hf_alibi's own ``core`` package, byte for byte
  (the entry module and its flat relative imports), and ``auto_map`` in config.json pointing at it,
  so that people without hf_alibi can load the checkpoint with ``trust_remote_code=True``;
* ``README.md``: a model card with the Hub's metadata header (kept when the folder already has one).

:class:`AlibiPreTrainedMixin` is the base of every ``Alibi<Class>`` made by the registry; it routes
``save_pretrained`` and ``push_to_hub`` through this module, so they keep the settings and the code.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers.dynamic_module_utils import get_relative_import_files
from transformers.utils import logging

from .core.compat import auto_class_names
from .core.config import get_settings, is_alibi_config
from .core.slopes import get_slopes_list
from .core.strategies import STRATEGIES
from .core.version import __version__

logger = logging.get_logger(__name__)

# The entry module auto_map names; it and the core modules it imports are copied unchanged.
REMOTE_CODE_FILE = Path(__file__).parent / "core" / "modeling_alibi.py"
REMOTE_MODULE = REMOTE_CODE_FILE.stem  # "modeling_alibi"
BUILTIN_STRATEGIES = frozenset(STRATEGIES)


def remote_code_files() -> list[Path]:
    """The files a checkpoint's remote code is made of: the entry module and, followed the way
    transformers' dynamic-module loader follows them, the core modules it imports."""
    return [REMOTE_CODE_FILE, *sorted(Path(f) for f in get_relative_import_files(REMOTE_CODE_FILE))]


# Auto class -> the Hub's pipeline tag, for the model card (first match wins).
PIPELINE_TAGS = {
    "AutoModelForCausalLM": "text-generation",
    "AutoModelForSeq2SeqLM": "text2text-generation",
    "AutoModelForMaskedLM": "fill-mask",
}


auto_classes_for = auto_class_names  # transformers' Auto class name -> model class name, per model_type


def auto_map_for(config) -> dict[str, str]:
    """The ``auto_map`` of an ALiBi config: every Auto class of its architecture, to the remote code."""
    settings = get_settings(config)
    base_config = next(c for c in type(config).__mro__ if getattr(c, "model_type", None) == settings.base_model_type)
    auto_map = {"AutoConfig": f"{REMOTE_MODULE}.Alibi{base_config.__name__}"}
    for auto_name, class_name in auto_classes_for(settings.base_model_type).items():
        auto_map[auto_name] = f"{REMOTE_MODULE}.Alibi{class_name}"
    return auto_map


def add_remote_code(folder: str | os.PathLike, config) -> bool:
    """Copy the remote code into ``folder`` and point config.json's ``auto_map`` at it. True when written.

    A row with a custom strategy (not one of the core's) cannot run from the core's files alone: no
    remote code is written then (a warning says so), and the folder loads only where that code runs.
    """
    folder = Path(folder)
    strategy = (get_settings(config).architecture or {}).get("strategy")
    if strategy is not None and strategy not in BUILTIN_STRATEGIES:
        logger.warning(
            f"No remote code written to {folder}: its architecture uses the custom strategy {strategy!r}, "
            "so it loads only after the code that registers it (hf_alibi.register_architecture)."
        )
        return False
    for source in remote_code_files():
        shutil.copyfile(source, folder / source.name)
    config_path = folder / "config.json"
    data = json.loads(config_path.read_text())
    data["auto_map"] = auto_map_for(config)
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return True


def _looks_like_hub_id(name: str | None) -> bool:
    if not name or os.path.exists(name) or name.startswith((".", "/", "~")) or "\\" in name:
        return False
    return name.count("/") <= 1 and all(part and " " not in part for part in name.split("/"))


def model_card(config, base_model: str | None = None, tags: list[str] | None = None) -> str:
    """README.md for an ALiBi checkpoint: the Hub's metadata header, how to load it, the settings.

    ``base_model`` is the Hub id the checkpoint was converted from; by default the config's
    ``_name_or_path`` when it looks like a Hub id (a local path is left out of the header).
    """
    from huggingface_hub import ModelCardData

    settings = get_settings(config)
    if base_model is None:
        candidate = getattr(config, "_name_or_path", None)
        base_model = candidate if _looks_like_hub_id(candidate) else None
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
    slopes = ", ".join(f"{s:.6g}" for s in get_slopes_list(settings.heads))
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
by [hf_alibi](https://pypi.org/project/hf_alibi/) {__version__}: its position embeddings are gone, and
every self-attention layer adds a fixed, head-specific linear penalty to its attention scores
({bias}), so it runs on inputs longer than it was trained on. Cross-attention has no position bias.

Note: converting does not train. A pretrained model converted to ALiBi must be fine-tuned before its
outputs are useful, because its weights were learned with position embeddings.

## How to load

With hf_alibi installed (`pip install hf_alibi`):

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
first and asks whether to run the code its `auto_map` names.)

Loading it with neither fails with an error: plain transformers never rebuilds it as the original
architecture with fresh position embeddings.

## Conversion settings

| setting | value |
|---|---|
{settings_rows}

Slopes `m_h`, head by head: {slopes}.
"""


def write_model_card(
    folder: str | os.PathLike, config, base_model: str | None = None, overwrite: bool = False
) -> bool:
    """Write README.md into ``folder`` unless one is there (or ``overwrite``). True when written."""
    path = Path(folder) / "README.md"
    if path.exists() and not overwrite:
        return False
    path.write_text(model_card(config, base_model=base_model))
    return True


def finish_folder(folder: str | os.PathLike, config, base_model: str | None = None) -> None:
    """What every saved ALiBi folder gets besides transformers' files: remote code, auto_map, card."""
    add_remote_code(folder, config)
    write_model_card(folder, config, base_model=base_model)


class HubConnectionError(ConnectionError):
    """The Hugging Face Hub could not be reached (offline, no network, HF_HUB_OFFLINE=1)."""


def _is_connection_problem(error: BaseException) -> bool:
    from huggingface_hub.errors import OfflineModeIsEnabled

    names = {cls.__name__ for cls in type(error).__mro__}
    return isinstance(error, OfflineModeIsEnabled | ConnectionError | TimeoutError) or bool(
        names & {"ConnectError", "ConnectTimeout", "TransportError", "NetworkError", "TimeoutException"}
    )


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    commit_message: str | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_description: str | None = None,
) -> Any:
    """Upload ``folder`` (a saved ALiBi checkpoint) to the Hub repo ``repo_id``, creating it if needed.

    The token is ``token`` or, as usual in huggingface_hub, ``HF_TOKEN`` or the stored login.
    Raises :class:`HubConnectionError` with what to do when the Hub cannot be reached.
    """
    from huggingface_hub import HfApi

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file() or "alibi" not in json.loads(config_path.read_text()):
        raise ValueError(
            f"{folder} holds no ALiBi checkpoint (config.json with 'alibi'): save an ALiBi model there first."
        )
    api = HfApi(token=token)
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            commit_message=commit_message or "Upload ALiBi checkpoint (hf_alibi)",
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )
    except Exception as error:
        if _is_connection_problem(error):
            raise HubConnectionError(
                f"Could not reach the Hugging Face Hub to push {repo_id!r} ({type(error).__name__}: {error}). "
                f"Nothing was uploaded; the checkpoint is complete in {folder}. Check the network (and that "
                "HF_HUB_OFFLINE is not set), then push it again, e.g. "
                f"`hf upload {repo_id} {folder}`."
            ) from error
        raise


class AlibiPreTrainedMixin:
    """Base of every ``Alibi<Class>``: saving keeps the ALiBi settings and the remote code.

    ``save_pretrained`` writes transformers' files, then ``modeling_alibi.py``, ``auto_map`` and a
    model card; ``push_to_hub`` saves that same folder and uploads it (transformers' own would
    replace the model card with a generic one).
    """

    def save_pretrained(
        self, save_directory, *args, is_main_process: bool = True, push_to_hub: bool = False, **kwargs
    ):
        push_kwargs = {}
        if push_to_hub:  # transformers would upload before the remote code is written: upload here
            repo_id = kwargs.pop("repo_id", str(save_directory).rstrip("/").split("/")[-1])
            for key in ("private", "commit_message", "commit_description", "token", "revision", "create_pr"):
                if key in kwargs:
                    push_kwargs[key] = kwargs.pop(key)
        # Weights are saved under this model's own parameter names. transformers' "original format"
        # renames some back to the base checkpoint's (GPT-NeoX: lm_head -> embed_out) for models it
        # loaded with a rename, but it looks the renames up by model_type, and "alibi_<type>" has none:
        # such a checkpoint would reload with a freshly initialised lm_head.
        kwargs.setdefault("save_original_format", False)
        result = super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process and is_alibi_config(self.config):
            finish_folder(save_directory, self.config)
            if push_to_hub:
                push_folder(save_directory, repo_id, **push_kwargs)
        return result

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str | None = "50GB",
        tags: list[str] | None = None,
    ):
        """Save to a temporary folder (weights, config with ``alibi`` and ``auto_map``, remote code,
        model card) and upload it to ``repo_id``. See :func:`push_folder`."""
        with tempfile.TemporaryDirectory() as tmp_dir:
            self.save_pretrained(tmp_dir, max_shard_size=max_shard_size)
            if tags:
                (Path(tmp_dir) / "README.md").write_text(model_card(self.config, tags=tags))
            return push_folder(
                tmp_dir,
                repo_id,
                private=private,
                commit_message=commit_message,
                commit_description=commit_description,
                token=token,
                revision=revision,
                create_pr=create_pr,
            )
