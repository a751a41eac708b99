"""The folder ``hf-alibi convert`` and ``hf-alibi recover`` write: the converted model and every companion
file of SRC that the ecosystem reads (sentence-transformers modules, generation config, chat template,
tokenizer files), with the original length limits lifted.

Companions are SRC's files less what the conversion replaces: weights (``*.safetensors``, ``*.bin``, ...,
and their index files), ``config.json``, Python code (the original's remote code; a tokenizer's own code,
named by ``auto_map`` in tokenizer_config.json, stays), README.md (the card is hf_alibi's), hidden files and
exports of the original weights (``onnx/``, ``openvino/``). Sub-folders are kept when modules.json names
them (sentence-transformers' ``1_Pooling/``, ``2_Dense/``: their own small weights included) or when
transformers reads them (``additional_chat_templates/``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..core.config import NO_MAXIMUM
from .checkpoints import CheckpointError, Source, name_and_place
from .saving import finish_folder

WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".ot", ".tflite", ".npz",
)  # fmt: skip
REPLACED = frozenset({"config.json", "README.md"})
CHAT_TEMPLATES_FOLDER = "additional_chat_templates"


def _tokenizer_code(folder: Path) -> set[str]:
    """Python files a tokenizer's ``auto_map`` names (its own code, which the converted folder keeps)."""
    try:
        auto_map = json.loads((folder / "tokenizer_config.json").read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return set()
    names = [value for values in auto_map.values() for value in (values if isinstance(values, list) else [values])]
    return {f"{name.split('--')[-1].rsplit('.', 1)[0]}.py" for name in names if isinstance(name, str)}


def _module_folders(folder: Path) -> list[str]:
    """Sub-folders of sentence-transformers modules (modules.json), less a Transformer module's (the model)."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        return []
    return [
        module["path"]
        for module in modules if isinstance(module, dict) and module.get("path")
        and str(module.get("type", "")).rsplit(".", 1)[-1] != "Transformer"
    ]  # fmt: skip


def companion_files(folder: str | os.PathLike) -> list[str]:
    """The files of the checkpoint folder ``folder`` a converted copy keeps (relative paths, sorted).

    >>> companion_files("all-MiniLM-L6-v2")  # doctest: +SKIP
    ['1_Pooling/config.json', 'config_sentence_transformers.json', 'modules.json', ..., 'vocab.txt']
    """
    folder = Path(folder).expanduser()
    return select_companions([p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()], folder)


def select_companions(paths: list[str], folder: str | os.PathLike) -> list[str]:
    """The companions among a checkpoint's file ``paths`` (relative, ``/``-separated: a folder's files or a
    Hub repo's); ``folder`` holds its modules.json and tokenizer_config.json when it has them."""
    folder = Path(folder)
    keep_code = _tokenizer_code(folder)
    kept_folders = (*_module_folders(folder), CHAT_TEMPLATES_FOLDER)
    files = []
    for path in paths:
        parts = path.split("/")
        if any(part.startswith(".") for part in parts):  # hidden files, ".cache", "..": never
            continue
        if len(parts) > 1:  # a module's own files (its small weights too: they are not the model's)
            if any(path.startswith(sub.strip("/") + "/") for sub in kept_folders):
                files.append(path)
            continue
        name = parts[0]
        if name in REPLACED or name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            continue
        if name.endswith(".py") and name not in keep_code:
            continue
        files.append(name)
    return sorted(set(files))


def _source(src: str | os.PathLike | Source) -> tuple[Path, list[str]]:
    """A local folder holding SRC's companions, and their names: SRC itself, or a Hub download of only them."""
    src, local = name_and_place(src)
    if local:
        folder = Path(src).expanduser()
        return folder, companion_files(folder)
    from huggingface_hub import HfApi, constants, snapshot_download

    try:
        if constants.HF_HUB_OFFLINE:  # what the local cache holds of it (the model was loaded from there)
            folder = Path(snapshot_download(src, local_files_only=True))
            return folder, companion_files(folder)
        paths = HfApi().list_repo_files(src)
        meta = snapshot_download(src, allow_patterns=["modules.json", "tokenizer_config.json"])
        names = select_companions(paths, meta)
        return Path(snapshot_download(src, allow_patterns=names)), names
    except Exception as error:  # an OSError would read as "cannot write OUT" in staged_output
        raise CheckpointError(
            f"Could not fetch the companion files of SRC {src!r} (tokenizer, modules, chat template) from the Hub: "
            f"{type(error).__name__}: {error}. Nothing was written; try again, or pass a checkpoint folder."
        ) from error


def copy_companions(src: str | os.PathLike | Source, folder: str | os.PathLike) -> list[str]:
    """Copy SRC's companion files (:func:`companion_files`; a Hub id: those of its files, downloaded) into
    ``folder``; returns their names."""
    source, names = _source(src)
    folder = Path(folder)
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, folder / name)
    return names


def lift_length_limits(folder: str | os.PathLike) -> None:
    """Remove the original's length limits from a converted folder's companions: the tokenizer's
    ``model_max_length`` becomes transformers' "no maximum" (VERY_LARGE_INTEGER, as tokenizers without one
    have: ``truncation=True`` then cuts nothing), and sentence-transformers' ``max_seq_length`` becomes null
    (it then takes min(model_max_length, max_position_embeddings): both "no maximum")."""
    folder = Path(folder)
    for name, key, value in (
        ("tokenizer_config.json", "model_max_length", NO_MAXIMUM),
        ("sentence_bert_config.json", "max_seq_length", None),
    ):
        path = folder / name
        if path.is_file():
            data = json.loads(path.read_text())
            data.pop("max_len", None)  # the old name of model_max_length
            data[key] = value
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_converted(
    folder: str | os.PathLike, model, src: str | os.PathLike | Source, tokenizer=None, recovery: str | None = None
) -> None:
    """Write the converted ``model`` into ``folder`` (a staging folder): SRC's companions first, then the
    weights, config.json (ALiBi settings, ``auto_map``), remote code, ``tokenizer`` (when given), the lifted
    limits and the model card (its ``base_model`` is SRC when SRC is a Hub id; ``recovery``: its recovery section).

    >>> with staged_output("gpt2-alibi") as staging:
    ...     write_converted(staging, hf_alibi.patch_model(model), "my-gpt2", tokenizer)
    """
    folder = Path(folder)
    copy_companions(src, folder)
    model.save_pretrained(folder)  # safetensors, config.json, generation_config.json, modeling_alibi.py
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)  # over SRC's copies; files it no longer writes stay (vocab.txt, ...)
    lift_length_limits(folder)
    (folder / "README.md").unlink(missing_ok=True)
    name, local = name_and_place(src)  # the jobs hand a Source: nothing asked again
    finish_folder(folder, model.config, base_model=None if local else name, recovery=recovery)
