"""One home for reading and writing checkpoint folders.

Every question the CLI, recovery, the Hub code and the scripts ask about a checkpoint has its one
answer here: is SRC a folder or a Hub id (:func:`source_kind`), what its config.json says
(:func:`read_config`; both at once, resolved once and carried by a job: :func:`open_source`), is that config an
ALiBi one (:func:`is_alibi`), which class loads it (:func:`model_class_for`), may OUT be written
(:func:`check_output`), and how OUT is written without ever leaving half a folder (:func:`staged_output`); how long
the original's inputs were is :func:`hf_alibi.convert.positions.original_length`. Bad input raises
:class:`CheckpointError` (a ``ValueError``) with one line that says what to do; the CLI prints it and exits with
status 2.

Example:
    >>> source = open_source("my-gpt2")           # a folder or a Hub id
    >>> check_output("my-gpt2", Path("out"), overwrite=False)
    >>> with staged_output("out") as staging:       # out appears only when the block succeeds
    ...     model.save_pretrained(staging)
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..core.names import is_alibi

# This module is imported by the command line's parser (hf_alibi/cli/), which answers --help and argument errors before
# torch and transformers are imported: what needs them (the registry, the config classes) is imported where used.

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or an output folder that cannot be written: one line saying what to do."""


# ---------------------------------------------------------------------------------------------------- input


def is_local(name: str | os.PathLike) -> bool:
    """Whether ``name`` means a path rather than a Hub id: it exists, starts with ``.``, ``/`` or ``~``,
    holds a backslash, or has more than one ``/`` (a Hub id is ``name`` or ``user/name``).

    >>> is_local("./gpt2"), is_local("openai-community/gpt2")
    (True, False)
    """
    name = os.fspath(name)
    return os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def is_hub_id(name: str | os.PathLike | None) -> bool:
    """Whether ``name`` is a valid Hub repo id that is not a local path (checked offline, at once).

    >>> is_hub_id("openai-community/gpt2"), is_hub_id("my model/v1")
    (True, False)
    """
    if not name or is_local(name):
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(os.fspath(name))
    except HFValidationError:
        return False
    return True


def source_kind(name: str | os.PathLike, label: str = "SRC") -> Literal["folder", "hub"]:
    """``"folder"`` for a path, ``"hub"`` for a Hub id; a :class:`CheckpointError` at once for a name that
    is neither, and for a Hub id not in the local cache while ``HF_HUB_OFFLINE=1`` (nothing waits on a network).

    >>> source_kind("my folder/v1")
    CheckpointError: SRC 'my folder/v1' is neither a folder nor a valid Hub id ...
    """
    if is_local(name):
        return "folder"
    if not is_hub_id(name):
        raise CheckpointError(
            f"{label} {os.fspath(name)!r} is neither a folder nor a valid Hub id (name or user/name): "
            "pass an existing checkpoint folder or a Hub id."
        )
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE and not _in_cache(name):
        raise CheckpointError(
            f"Could not read the config of {label} {os.fspath(name)!r}: HF_HUB_OFFLINE is set and it is not in "
            "the local cache. Download it first (unset HF_HUB_OFFLINE), or pass a checkpoint folder."
        )
    return "hub"


def check_source(src: str | os.PathLike, label: str = "SRC") -> Literal["folder", "hub"]:
    """:func:`source_kind`, and for a folder: it exists and holds a config.json that is JSON. What can be told of
    SRC without the network or transformers (the command line asks it before the library is imported); a
    :class:`CheckpointError` otherwise.

    >>> check_source("no-such-folder/x/y")
    CheckpointError: SRC 'no-such-folder/x/y' is not a folder. ...
    """
    kind = source_kind(src, label)
    if kind == "folder":
        src = os.fspath(src)
        path = Path(src).expanduser()
        if not path.is_dir():
            raise CheckpointError(
                f"{label} {src!r} is not a folder. Pass a checkpoint folder (with config.json) or a Hub id."
            )
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{label} {src!r} has no config.json: it is not a transformers checkpoint folder.")
        try:
            json.loads((path / "config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{label} {src!r} has a config.json that is not valid JSON ({error}).") from error
    return kind


def _in_cache(name: str | os.PathLike) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(os.fspath(name), "config.json"), str)


def check_hub_source(name: str | os.PathLike, label: str = "SRC") -> None:
    """For a Hub id not in the local cache: one request for its config.json, without retries, so that a
    name that is neither a folder here nor a model on the Hub, or a Hub that cannot be reached, is a
    :class:`CheckpointError` at once (transformers would retry the download for half a minute first).

    >>> check_hub_source("does-not-exist")
    CheckpointError: SRC 'does-not-exist' is no folder here, and the Hugging Face Hub could not be reached ...
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError

    name = os.fspath(name)
    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=10)
    except RepositoryNotFoundError as error:
        raise CheckpointError(
            f"{label} {name!r} is no folder here, and no model on the Hugging Face Hub that your token can read "
            f"({type(error).__name__}). Pass an existing checkpoint folder (./{name} for one here) or a Hub id."
        ) from error
    except EntryNotFoundError as error:
        raise CheckpointError(
            f"{label} {name!r}: the Hub repository has no config.json; it is not a transformers checkpoint."
        ) from error
    except HfHubHTTPError:
        return  # another answer from the Hub (rate limit, server error): transformers' download says it
    except Exception as error:  # the network: no DNS, refused, timed out
        raise CheckpointError(
            f"{label} {name!r} is no folder here, and the Hugging Face Hub could not be reached to look it up as a "
            f"Hub id ({type(error).__name__}: {error}). Pass an existing checkpoint folder (./{name} for one here), "
            "or check the network (with HF_HUB_OFFLINE=1 only the local cache is read)."
        ) from error


@dataclass(frozen=True)
class Source:
    """A checkpoint to read, resolved once (:func:`open_source`): the name as given, whether it is a folder here or a
    Hub id (``kind``), and its config.json. What a job carries from its first check to its last write (the class
    that loads it, the tokenizer question, the model card's ``base_model``) instead of asking again.

    >>> source = open_source("my-gpt2")  # doctest: +SKIP
    >>> source.kind, source.config["model_type"], source.model_class().__name__
    ('folder', 'gpt2', 'GPT2LMHeadModel')
    """

    name: str
    kind: Literal["folder", "hub"]
    config: dict[str, Any] = field(repr=False)
    label: str = "SRC"

    @property
    def local(self) -> bool:
        return self.kind == "folder"

    def has_tokenizer(self) -> bool | None:
        """:func:`has_tokenizer` of this source."""
        return has_tokenizer(self)

    def model_class(self) -> type:
        """The transformers (or Alibi) class that loads it (:func:`model_class_for`)."""
        return model_class_for(self.config)


def open_source(src: str | os.PathLike | Source, label: str = "SRC") -> Source:
    """The checkpoint ``src`` (folder or Hub id) resolved once: checked (:func:`check_source`; a Hub id not in the
    local cache asked once, :func:`check_hub_source`) and its config.json read as transformers reads it, with a
    ``model_type``; a :class:`CheckpointError` that says what is wrong otherwise. A :class:`Source` is returned as
    it is."""
    if isinstance(src, Source):
        return src
    from transformers import PretrainedConfig

    src = os.fspath(src)
    kind = check_source(src, label)
    if kind == "hub" and not _in_cache(src):
        check_hub_source(src, label)
    try:
        config_dict, _ = PretrainedConfig.get_config_dict(src)
    except OSError as error:
        raise CheckpointError(
            f"Could not read the config of {label} {src!r}: {error} "
            "Pass a checkpoint folder or a Hub id you can reach."
        ) from error
    except ValueError as error:
        raise CheckpointError(f"{label} {src!r} has a config.json that transformers cannot read ({error}).") from error
    if "model_type" not in config_dict:
        raise CheckpointError(
            f"{label} {src!r}: config.json has no model_type; hf_alibi cannot tell its architecture."
        )
    return Source(src, kind, config_dict, label)


def read_config(src: str | os.PathLike, label: str = "SRC") -> dict[str, Any]:
    """config.json of the checkpoint ``src`` (folder or Hub id): :func:`open_source`'s.

    >>> read_config("my-gpt2")["model_type"]
    'gpt2'
    """
    return open_source(src, label).config


def has_tokenizer(src: str | os.PathLike | Source) -> bool | None:
    """True/False for a local folder (tokenizer files there or not); None (unknown: try) for a Hub id."""
    name, local = name_and_place(src)
    if not local:
        return None
    return any((Path(name).expanduser() / file).is_file() for file in TOKENIZER_FILES)


def name_and_place(src: str | os.PathLike | Source) -> tuple[str, bool]:
    """SRC's name and whether it is a folder here: what a :class:`Source` carries, else asked of the name."""
    if isinstance(src, Source):
        return src.name, src.local
    return os.fspath(src), is_local(src)


def model_class_for(config_dict: Mapping[str, Any]) -> type:
    """The transformers class to load a checkpoint with: its ``architectures`` entry if the registry converts
    it, else the first Auto class of the architecture (causal LM, seq2seq LM, masked LM, then the bare model).
    A :class:`CheckpointError` for an ALiBi checkpoint or an architecture hf_alibi does not convert.

    >>> model_class_for({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}).__name__
    'GPT2LMHeadModel'
    """
    import transformers

    from ..convert.registry import alibi_classes, get_architecture
    from ..core.compat import auto_class_names
    from ..core.config import MODEL_TYPE_PREFIX

    model_type = config_dict["model_type"]
    if is_alibi(config_dict) or str(model_type).startswith(MODEL_TYPE_PREFIX):
        raise CheckpointError(
            f"SRC is already an ALiBi checkpoint (model_type {model_type!r}); there is nothing to convert."
        )
    try:
        get_architecture(model_type)
    except ValueError as error:
        raise CheckpointError(str(error)) from error
    convertible = {cls.__name__: cls for cls in alibi_classes(model_type)}
    for name in config_dict.get("architectures") or []:
        if name in convertible:
            return convertible[name]
    auto = auto_class_names(model_type)
    for auto_name in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModel"):
        if auto_name in auto and hasattr(transformers, auto[auto_name]):
            return getattr(transformers, auto[auto_name])
    raise CheckpointError(f"hf_alibi found no model class to load {model_type!r} with.")


# ---------------------------------------------------------------------------------------------------- output


def check_output(src: str | os.PathLike | None, out: str | os.PathLike, overwrite: bool = False) -> None:
    """Refuse, before anything is loaded, an OUT that overlaps the local folder ``src``, is a file, lies
    inside a file, or is a non-empty folder without ``overwrite``. Raises :class:`CheckpointError`.

    >>> check_output("my-gpt2", "my-gpt2/alibi")
    CheckpointError: OUT 'my-gpt2/alibi' overlaps SRC 'my-gpt2'; ...
    """
    out = Path(out)
    out_resolved = out.expanduser().resolve()
    if src is not None and is_local(src):
        src_resolved = Path(src).expanduser().resolve()
        if (
            out_resolved == src_resolved
            or src_resolved in out_resolved.parents
            or out_resolved in src_resolved.parents
        ):
            raise CheckpointError(
                f"OUT {str(out)!r} overlaps SRC {os.fspath(src)!r}; hf_alibi never writes into SRC. Pick another OUT."
            )
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"OUT {str(out)!r} exists and is not a folder.")
    existing = next(parent for parent in out_resolved.parents if parent.exists())
    if not existing.is_dir():
        raise CheckpointError(
            f"OUT {str(out)!r} is inside the file {str(existing)!r}, not a folder. Pick another OUT."
        )
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(
            f"OUT {str(out)!r} exists and is not empty. Pass --overwrite to replace it, or pick another OUT."
        )


@contextmanager
def staged_output(out: str | os.PathLike) -> Iterator[Path]:
    """A staging folder next to ``out``, made at once (so a place that cannot be written fails before
    anything is loaded or trained), renamed to ``out`` when the block ends without an error (replacing
    an old ``out`` only then). On any error the staging folder and the parent folders made for it are
    removed, and an ``OSError`` becomes a :class:`CheckpointError` saying nothing was written. A run killed
    outright (SIGKILL) removes nothing: the next one for the same ``out`` does (:func:`sweep_staging`).

    >>> with staged_output("alibi") as staging:
    ...     model.save_pretrained(staging)
    """
    out = Path(out)
    parent = out.expanduser().resolve().parent
    created = [folder for folder in (parent, *parent.parents) if not folder.exists()]  # removed on failure
    staging = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        sweep_staging(out)  # the staging folders of runs for this OUT that died (SIGKILL, the OOM killer)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
        (staging / STAGING_MARK).write_text(json.dumps(_owner()))
        yield staging
        (staging / STAGING_MARK).unlink()
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException as error:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # innermost first; only the folders made here, and only if empty
            try:
                folder.rmdir()
            except OSError:
                break
        if isinstance(error, OSError):
            reason = error.strerror or str(error)
            where = f" ({error.filename})" if error.filename else ""
            raise CheckpointError(
                f"Could not write OUT {str(out)!r}: {reason}{where}. Nothing was written; "
                "pick a folder you can write to."
            ) from error
        raise


# In each staging folder while it is written: who writes it (pid, its start time, host), for sweep_staging
STAGING_MARK = ".hf_alibi-staging.json"
logger = logging.getLogger("hf_alibi")


def sweep_staging(out: str | os.PathLike) -> list[str]:
    """Remove the staging folders beside ``out`` (``.OUT.xxxxxxxx``) that runs which died left behind, and name with
    their size those whose writer this machine cannot see (another host, or no mark); a run alive is left alone.
    Returns the lines it logged (``hf_alibi`` logger, warnings).

    A folder is dead when its mark names a process of this host that no longer runs (the pid gone, or reused by a
    process started at another time). Folders without a mark, or of other hosts, are never removed: a run writing
    them may be alive there.
    """
    out = Path(out).expanduser()
    lines = []
    for folder in sorted(out.parent.glob(f".{glob.escape(out.name)}.*")):
        if not folder.is_dir() or not _STAGING_NAME.fullmatch(folder.name[len(out.name) + 2 :]):
            continue
        owner = _read_owner(folder)
        size = _size(folder)
        alive = _alive(owner)
        if alive is False:
            shutil.rmtree(folder, ignore_errors=True)
            lines.append(
                f"removed {folder} ({size}): the staging folder of a run for {out.name} that died (pid {owner['pid']})"
            )
        elif alive is None:
            where = "another host's run" if owner else "a run that left no mark"
            lines.append(
                f"left {folder} ({size}) alone: the staging folder of {where} for {out.name}; remove it if no run is "
                "writing it"
            )
    for line in lines:
        logger.warning(line)
    return lines


_STAGING_NAME = re.compile(r"[a-z0-9_]{8}")  # tempfile.mkdtemp's random part


def _owner() -> dict:
    return {"pid": os.getpid(), "started": _started(os.getpid()), "host": socket.gethostname()}


def _started(pid: int) -> float | None:
    try:
        import psutil  # accelerate's dependency

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 - gone, or not allowed to look: unknown
        return None


def _read_owner(folder: Path) -> dict | None:
    try:
        owner = json.loads((folder / STAGING_MARK).read_text())
        return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def _alive(owner: dict | None) -> bool | None:
    """True / False for a writer of this host; None where this process cannot tell (no mark, another host)."""
    if owner is None or owner.get("host") != socket.gethostname():
        return None
    import psutil  # accelerate's dependency

    try:
        started = psutil.Process(owner["pid"]).create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # not allowed to look: it runs
        return True
    return owner.get("started") is None or abs(started - owner["started"]) < 1.0  # else the pid was reused


def _size(folder: Path) -> str:
    total = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
    if total < 1024:
        return f"{total} B"
    for unit in ("KB", "MB"):
        total /= 1024
        if total < 1024:
            return f"{total:.1f} {unit}"
    return f"{total / 1024:.1f} GB"


__all__ = [
    "CheckpointError",
    "Source",
    "TOKENIZER_FILES",
    "check_hub_source",
    "check_output",
    "check_source",
    "has_tokenizer",
    "is_alibi",
    "is_hub_id",
    "is_local",
    "model_class_for",
    "open_source",
    "read_config",
    "source_kind",
    "staged_output",
    "sweep_staging",
]
