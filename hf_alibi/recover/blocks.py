"""The text: files read, tokenized into one stream, cut into training blocks."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from ..hub.checkpoints import CheckpointError


def read_texts(path: str | os.PathLike) -> list[str]:
    """The texts of a local file: ``.txt`` (the whole file, one text), ``.jsonl`` / ``.json`` (the ``text``
    field of every record). Raises :class:`~hf_alibi.hub.checkpoints.CheckpointError` (a ``ValueError``) when
    the file is missing, unreadable or holds no text.

    >>> read_texts("notes.jsonl")    # {"text": ...} per line
    ['first note', 'second note']
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(
            f"--train_file {str(path)!r} is not a file. Pass a .txt or .jsonl file of unlabeled text."
        )
    try:
        raw = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as error:
        raise CheckpointError(f"--train_file {str(path)!r} could not be read as UTF-8 text ({error}).") from error
    if path.suffix in (".jsonl", ".json"):
        try:
            records = [json.loads(line) for line in raw.splitlines() if line.strip()]
            if len(records) == 1 and isinstance(records[0], list):
                records = records[0]
            texts = [r["text"] for r in records if isinstance(r, dict) and isinstance(r.get("text"), str)]
        except json.JSONDecodeError as error:
            raise CheckpointError(
                f"--train_file {str(path)!r} is not JSON lines with a 'text' field ({error})."
            ) from error
    else:
        texts = [raw]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise CheckpointError(f"--train_file {str(path)!r} holds no text. Pass the unlabeled text to recover with.")
    return texts


class Blocks(torch.utils.data.Dataset):
    """Training blocks (N, L) as the Trainer's items: ``input_ids`` and, with ``labels``, the same ids as labels."""

    def __init__(self, blocks: torch.Tensor, labels: bool):
        self.blocks, self.labels = blocks, labels

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = {"input_ids": self.blocks[index]}
        if self.labels:
            item["labels"] = self.blocks[index]
        return item


def token_stream(texts: Sequence[str], tokenizer) -> torch.Tensor:
    """The texts tokenized without special tokens and joined into one 1-d stream, separated by the
    tokenizer's eos (else sep) token when it has one.

    >>> token_stream(["def f():", "return 1"], tokenizer).shape
    torch.Size([9])
    """
    if isinstance(texts, str):
        texts = [texts]
    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    ids: list[int] = []
    for text in texts:
        if not text or not text.strip():
            continue
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if separator is not None:
            ids.append(separator)
    return torch.tensor(ids, dtype=torch.long)


Frame = tuple[tuple[int, ...], tuple[int, ...]]
NO_FRAME: Frame = ((), ())


def special_frame(tokenizer) -> Frame:
    """The ids ``tokenizer`` puts before and after a text's own ids when it adds its special tokens:
    BERT's ``([CLS],), ([SEP],)``, RoBERTa's ``(<s>,), (</s>,)``, T5's ``(), (</s>,)``; ``((), ())`` when it
    adds none (or when there is no tokenizer). Found by tokenizing a probe with and without them.

    >>> special_frame(bert_tokenizer)
    ((101,), (102,))
    """
    if tokenizer is None:
        return NO_FRAME
    probe = "hello world"
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return tuple(full[:start]), tuple(full[start + len(plain) :])
    return NO_FRAME


def frame_size(frame: Frame) -> int:
    """How many special tokens ``frame`` puts around a text."""
    return len(frame[0]) + len(frame[1])


def frame_rows(rows: torch.Tensor, frame: Frame = NO_FRAME) -> torch.Tensor:
    """Each row of ``rows`` (N, C) between the frame's prefix and suffix: (N, C + :func:`frame_size`).

    >>> frame_rows(torch.tensor([[10, 11]]), ((1,), (2,)))
    tensor([[ 1, 10, 11,  2]])
    """
    prefix, suffix = (rows.new_tensor(part).expand(len(rows), -1) for part in frame)
    return torch.cat([prefix, rows, suffix], dim=1)


def framed_blocks(stream: torch.Tensor, length: int, frame: Frame = NO_FRAME) -> torch.Tensor:
    """Blocks (N, length) of ``stream``: consecutive pieces of ``length - frame_size(frame)`` tokens,
    each between the frame's prefix and suffix, so an encoder trains on inputs shaped like the ones it reads
    (``[CLS] ... [SEP]``). With no frame, the stream cut into blocks of ``length``. N may be 0.

    >>> framed_blocks(torch.arange(10, 16), 4, ((1,), (2,)))
    tensor([[ 1, 10, 11,  2],
            [ 1, 12, 13,  2],
            [ 1, 14, 15,  2]])
    """
    content = length - frame_size(frame)
    if content < 1:
        raise ValueError(
            f"length {length} leaves no room for text between the tokenizer's {frame_size(frame)} special "
            "tokens. Pass a larger length."
        )
    n = stream.numel() // content
    return frame_rows(stream[: n * content].view(n, content), frame)


def mlm_collator(tokenizer, probability: float = 0.15):
    """A collator that masks ``probability`` of the tokens for the MLM share of an encoder's loss."""
    from transformers import DataCollatorForLanguageModeling

    if tokenizer is None or tokenizer.mask_token_id is None:
        raise ValueError("lm_weight > 0 for an encoder needs a tokenizer with a mask token (for the MLM loss).")
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=probability)

    def collate(features):
        return collator([{"input_ids": f["input_ids"]} for f in features])

    return collate


def as_stream(texts, tokenizer, name: str) -> torch.Tensor:
    """``texts`` (strings, or token ids as a tensor) as one 1-d stream of ids; a ``ValueError`` when empty."""
    if isinstance(texts, torch.Tensor):
        stream = texts.reshape(-1).long()
    else:
        if tokenizer is None:
            raise ValueError(f"{name} are strings: pass the tokenizer too (or pass token ids as a tensor).")
        stream = token_stream(texts, tokenizer)
    if stream.numel() == 0:
        raise ValueError(f"{name} holds no text (nothing to distil on). Pass the unlabeled text to recover with.")
    return stream
