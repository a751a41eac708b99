"""Packed rows: several documents in one row, told apart by position ids that restart.

transformers' padding-free format (``DataCollatorWithFlattening``, TRL's padding-free and packed SFT)
concatenates documents into one row with no attention mask and position ids that restart for each
document (``[0..9, 0..6]``). A new document starts wherever a position id is not the previous one plus 1,
exactly as ``transformers.masking_utils.find_packed_sequence_indices`` reads them.

ALiBi suits packing: inside a document ``|i - j|`` does not depend on where the document starts in the row.
What must follow the documents is the mask (a query sees only keys of its own document) and the sinks
(the first tokens of each document). A converted model keeps the documents of a packed row apart on every
attention path and for every architecture, whether or not transformers does it for the original (it does
not for OPT or the encoders, nor for the Llama family with ``use_cache=True``): each token's document is
recorded once per forward (``forward.AlibiForward.documents``), as the index where its document starts.
"""

from __future__ import annotations

import torch


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """For every token, the index in its row where its document starts: ``(B|1, L)`` long.

    A row is packed when every place its ids do not go up by 1 is a restart at the row's first id
    (``[0..9, 0..6]``; ``DataCollatorWithFlattening(position_ids_start=2)`` gives ``[2..11, 2..8]``). Any other
    ids (shuffled, offset) are one document, ignored like every position id of a converted model. Tensor
    operations only: the same answer while torch.compile traces.

    >>> document_starts(torch.tensor([[0, 1, 2, 0, 1, 0], [4, 5, 6, 7, 8, 9]]))
    tensor([[0, 0, 0, 3, 3, 5],
            [0, 0, 0, 0, 0, 0]])
    """
    positions = position_ids.reshape(-1, position_ids.shape[-1])
    index = torch.arange(positions.shape[-1], device=positions.device)
    new = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1
    packed = (~new | (positions == positions[:, :1])).all(dim=-1, keepdim=True)  # every break is a restart
    new = (new & packed) | (index == 0)
    return torch.where(new, index, torch.zeros_like(index)).cummax(dim=-1).values


def is_packed(starts: torch.Tensor) -> bool:
    """Whether :func:`document_starts` found more than one document in some row (reads the tensor)."""
    return bool(starts.any())


def same_document(starts: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """Bool ``(B|1, 1, q, kv)``: query and key belong to the same document (queries and keys are the row's
    tokens: a packed forward has no cache)."""
    if not q_len == kv_len == starts.shape[-1]:
        raise ValueError(
            f"A packed row (position ids that restart) was recorded for {starts.shape[-1]} tokens, but this "
            f"attention layer sees {q_len} queries and {kv_len} keys: packed rows run without a KV cache "
            "(pass use_cache=False and no cache), or pass an attention_mask for a plain batch."
        )
    return (starts[:, :, None] == starts[:, None, :])[:, None]


def cumulative_lengths(starts: torch.Tensor, batch: int) -> tuple[torch.Tensor, int]:
    """flash-attn's varlen ``cu_seqlens`` (int32, documents of all ``batch`` rows flattened in order) and the
    longest document, from :func:`document_starts`."""
    starts = starts.expand(batch, -1)
    length = starts.shape[-1]
    index = torch.arange(length, device=starts.device)
    first = (starts == index).reshape(-1)  # (B * L,): a document starts here
    offsets = torch.arange(batch * length, device=starts.device)[first]
    cu_seqlens = torch.cat([offsets, offsets.new_full((1,), batch * length)]).to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max())
