"""The embedded corpus (needs no download) and a byte-level BPE tokenizer trained on it.

Every machine that runs Python has the source of its standard library. :func:`embedded_corpus`
turns the running interpreter's ``*.py`` files into a text corpus, split by file into train /
validation / test with a hash of each file's relative path (deterministic: the same interpreter
gives the same split everywhere, and adding a file never moves another one). The corpus and the
tokenizer are cached on disk.

Example:
    >>> from hf_alibi.train.data import embedded_corpus, train_tokenizer
    >>> corpus = embedded_corpus()            # DatasetDict: train / validation / test, column "text"
    >>> tokenizer = train_tokenizer(corpus["train"]["text"], vocab_size=8192)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
# Per 100 files: 90 train, 5 validation, 5 test.
SPLIT_BOUNDS = {"train": 90, "validation": 95, "test": 100}
# Directories of the standard library left out: third-party packages, and the interpreter's own test
# suite (test data with deliberately odd encodings and generated files, not the library's text).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
EOS_TOKEN = "<|endoftext|>"
CORPUS_VERSION = 1


def default_cache_dir() -> Path:
    """``$HF_ALIBI_CACHE``, else ``~/.cache/hf_alibi``."""
    return Path(os.environ.get("HF_ALIBI_CACHE", Path.home() / ".cache" / "hf_alibi"))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
    """The split a file belongs to: a function of its path only (sha256), so it never changes."""
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest()[:8], 16) % 100
    return next(name for name in SPLITS if bucket < SPLIT_BOUNDS[name])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative paths (posix, sorted) of the standard library's ``*.py`` files that decode as UTF-8."""
    root = stdlib_root() if root is None else Path(root)
    paths = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(relative.parts[:-1]) or not path.is_file():
            continue
        paths.append(relative.as_posix())
    return sorted(paths)


def _read(root: Path, relative: str) -> str | None:
    try:
        return (root / relative).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def build_corpus_files(cache_dir: Path | str | None = None, root: Path | None = None) -> dict[str, Path]:
    """Write (once) ``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` and return their paths.

    One JSON line per source file: ``{"path": ..., "text": ...}``. The cache directory is keyed by
    the interpreter version and a fingerprint of the file list and sizes, so another interpreter (or
    an edited standard library) gets a corpus of its own instead of a stale one.
    """
    root = stdlib_root() if root is None else Path(root)
    files = stdlib_files(root)
    fingerprint = hashlib.sha256(
        json.dumps([CORPUS_VERSION, [(f, (root / f).stat().st_size) for f in files]]).encode()
    ).hexdigest()[:16]
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    directory = Path(cache_dir or default_cache_dir()) / f"stdlib-corpus-{version}-{fingerprint}"
    paths = {split: directory / f"{split}.jsonl" for split in SPLITS}
    if all(path.exists() for path in paths.values()):
        return paths
    directory.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[str]] = {split: [] for split in SPLITS}
    for relative in files:
        text = _read(root, relative)
        if text is not None and text.strip():
            rows[split_of(relative)].append(json.dumps({"path": relative, "text": text}))
    for split, path in paths.items():
        # Written to a temporary name then renamed: two processes (DDP ranks) may build it at once.
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("\n".join(rows[split]) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    return paths


def embedded_corpus(cache_dir: Path | str | None = None, root: Path | None = None):
    """The standard-library corpus as a ``datasets.DatasetDict`` (train / validation / test; columns
    ``path`` and ``text``, one row per source file, in sorted path order)."""
    import datasets

    paths = build_corpus_files(cache_dir, root)
    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_json(str(path), cache_dir=str(path.parent / "hf"))
            for split, path in paths.items()
        }
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, save_dir: Path | str | None = None):
    """Train a byte-level BPE tokenizer (the ``tokenizers`` library, GPT-2's scheme) on ``texts``.

    Returns a ``transformers.PreTrainedTokenizerFast`` whose bos / eos / unk / pad token is
    ``<|endoftext|>``; saved with ``save_pretrained`` to ``save_dir`` when given.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )
    if save_dir is not None:
        fast.save_pretrained(str(save_dir))
    return fast


def embedded_tokenizer(corpus, vocab_size: int = 8192, cache_dir: Path | str | None = None, column: str = "text"):
    """The tokenizer trained on ``corpus["train"][column]``, cached by vocabulary size and a hash of the text."""
    from transformers import PreTrainedTokenizerFast

    texts = list(corpus["train"][column])
    digest = hashlib.sha256()
    for text in texts:
        digest.update(hashlib.sha256(text.encode()).digest())
    key = digest.hexdigest()[:16]
    directory = Path(cache_dir or default_cache_dir()) / f"bpe-{vocab_size}-{key}"
    if (directory / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    tokenizer = train_tokenizer(texts, vocab_size, save_dir=tmp)
    try:
        os.replace(tmp, directory)
    except OSError:  # another process finished first: use its copy
        pass
    return tokenizer


def load_raw_datasets(
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    test_file: str | None = None,
    keep_linebreaks: bool = True,
    validation_split_percentage: int = 5,
    cache_dir: str | None = None,
):
    """scripts/run_clm.py's data, as transformers' run_clm.py reads it: a Hub dataset (``dataset_name``), local
    files (``train_file``, ``.txt``, ``.json``, ``.csv``, ...), else the embedded corpus (:func:`embedded_corpus`); a
    split without validation gives ``validation_split_percentage`` % of its train split to validation.

    >>> load_raw_datasets()["train"].column_names  # doctest: +SKIP
    ['path', 'text']
    """
    import datasets

    pct = validation_split_percentage
    if dataset_name is not None:
        raw = datasets.load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir)
        if "validation" not in raw:
            raw["validation"] = datasets.load_dataset(dataset_name, dataset_config_name, split=f"train[:{pct}%]")
            raw["train"] = datasets.load_dataset(dataset_name, dataset_config_name, split=f"train[{pct}%:]")
        return raw
    if train_file is None:
        logger.info("No dataset given: using the embedded corpus (this interpreter's standard library source).")
        return embedded_corpus(cache_dir)
    files = {"train": train_file, "validation": validation_file, "test": test_file}
    extension = train_file.rsplit(".", 1)[-1]
    extension = "text" if extension == "txt" else extension
    kwargs = {"keep_linebreaks": keep_linebreaks} if extension == "text" else {}
    files = {split: path for split, path in files.items() if path is not None}
    raw = datasets.load_dataset(extension, data_files=files, cache_dir=cache_dir, **kwargs)
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=pct / 100, shuffle=False)
        raw["train"], raw["validation"] = split["train"], split["test"]
    return raw
