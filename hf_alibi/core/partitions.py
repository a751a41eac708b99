"""Partitioned weights: the one gate every conversion's weight read goes through (:func:`whole_weights`).

A conversion reads weights: ``position_mean`` folds a position table's mean into the token embeddings,
``table_max_wavelength`` keeps a table's periodic part, :func:`hf_alibi.fit_slopes` runs the original forward,
``hf-alibi recover`` warm-starts from the removed table, and the checks read shapes. A weight may be a partition:

* **DeepSpeed ZeRO-3** (``deepspeed.zero.Init``, which ``from_pretrained`` uses once a ZeRO-3
  ``TrainingArguments`` exists): each rank holds a flat slice, the parameter itself is an empty ``(0,)`` tensor
  and ``ds_shape`` is its shape. Read as it is, a mean is of nothing and a shape is ``(0,)``: silently wrong.
  The gate gathers every parameter whole on every rank for the block (``deepspeed.zero.GatheredParameters``,
  a collective: every rank converts, as every rank loaded), and with ``write=True`` rank 0's values are the
  ones kept and partitioned again on the way out (every rank computes the same ones).
* **FSDP2 / tensor parallel** (``DTensor``): a forward gathers what it needs itself, so a forward-only read
  (:func:`hf_alibi.fit_slopes`) runs as it is; a conversion, which replaces modules and writes weights, and any
  other read (the GGUF export, the warm start's table) are refused: convert first, then shard (``fully_shard`` or
  ``accelerate``'s ``prepare`` after ``patch_model``).
* **the meta device** (a model built empty, its weights to load later): nothing to read; refused where the
  conversion reads values. A conversion that reads none (``preset=None``: the paper's method) runs, as before.

:func:`whole_shape` gives a weight's shape whatever holds it (the checks and the rebuild of a saved conversion
under ``zero.Init`` read shapes, not values).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def partitioning(tensor: torch.Tensor) -> str | None:
    """How ``tensor`` is held when not whole on this process: ``"zero3"`` (a DeepSpeed ZeRO-3 partition),
    ``"dtensor"`` (FSDP2 or tensor parallel), ``"meta"`` (no data), or ``None`` (whole)."""
    if hasattr(tensor, "ds_id") and tuple(tensor.shape) != tuple(tensor.ds_shape):  # not gathered at the moment
        return "zero3"
    if _is_dtensor(tensor):
        return "dtensor"
    if tensor.is_meta:
        return "meta"
    return None


def whole_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of the whole weight: a ZeRO-3 partition's ``ds_shape`` (its own shape is ``(0,)``); a DTensor's
    and a meta tensor's own shape already is."""
    shape = getattr(tensor, "ds_shape", None)
    return torch.Size(shape) if shape is not None else tensor.shape


@contextlib.contextmanager
def whole_weights(
    model: nn.Module, what: str, *, write: bool = False, reads: bool = True, forward: bool = False
) -> Iterator[None]:
    """Every parameter of ``model`` whole on this process for the block, or a one-line ``ValueError`` (nothing
    read, nothing changed) where they cannot be: see the module's docstring. ``what`` names the caller in the
    message; ``write``: the block changes weights or modules; ``reads``: the block reads weight values (a
    conversion that reads none runs on the meta device); ``forward``: it reads them only through the model's own
    forward (which gathers DTensors itself)."""
    kinds: dict[str, list[torch.Tensor]] = {}
    for parameter in model.parameters():  # tied weights (GPT-2's wte and lm_head) once
        kind = partitioning(parameter)
        if kind is not None:
            kinds.setdefault(kind, []).append(parameter)
    if "meta" in kinds and reads:
        raise ValueError(
            f"{what} reads the model's weights, but {len(kinds['meta'])} are on the meta device (a model built "
            "empty): load them first (from_pretrained, or load_state_dict after to_empty), or convert with "
            "preset=None, which reads none."
        )
    if "dtensor" in kinds and (write or (reads and not forward)):
        raise ValueError(
            f"{what} {'changes' if write else 'reads'} the model's weights, but they are sharded DTensors (FSDP2 or "
            "tensor parallel): use the whole model first, then shard it (patch_model before fully_shard or "
            "accelerate's prepare)."
        )
    if "zero3" not in kinds:
        yield
        return
    try:  # in a try block: transformers' check_imports lets remote code load where DeepSpeed is not installed
        import deepspeed  # a ZeRO-3 parameter exists: DeepSpeed made it (deepspeed.zero is an attribute, no module)
    except ImportError as error:  # pragma: no cover - a ds_id without DeepSpeed
        raise ValueError(f"{what}: the weights are ZeRO-3 partitions, but DeepSpeed cannot be imported.") from error
    with deepspeed.zero.GatheredParameters(kinds["zero3"], modifier_rank=0 if write else None):
        yield


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without torch.distributed
        return False
    return isinstance(tensor, DTensor)
