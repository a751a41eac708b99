"""The bias path: the ALiBi bias merged with transformers' mask into one float mask, shared per forward."""

from __future__ import annotations

import threading

import torch

from .compat import is_exporting
from .packing import same_document
from .slopes import CAUSAL, LEARNED, alibi_bias


def attends(mask: torch.Tensor) -> torch.Tensor:
    """transformers' 4D mask as a boolean one, True where a query attends: a boolean mask as it is, an additive one
    where it is above half its dtype's lowest value (masked entries are ``finfo(dtype).min``, kept ones 0)."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def merge_bias_and_mask(bias: torch.Tensor, attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """One additive float mask in ``dtype`` from the fp32 bias and transformers' mask.

    ``attention_mask`` is what transformers' mask interface made: ``None``, a boolean mask
    (True = attend) or an additive float mask whose masked entries are ``finfo(dtype).min``.
    Masked entries come out as exactly ``finfo(dtype).min``: the sum is clamped, so a positive
    bias can never bring a masked key back, and a fully masked row stays finite.
    """
    masked_value = torch.finfo(dtype).min
    if attention_mask is None:
        merged = bias
    elif attention_mask.dtype == torch.bool:
        merged = torch.where(attention_mask, bias, masked_value)
    else:
        merged = (bias + attention_mask.float()).clamp_min(masked_value)
    return merged if merged.dtype == dtype else merged.to(dtype)  # the no-op .to is a call a decoding step skips


def separate_documents(
    mask: torch.Tensor | None, starts: torch.Tensor, q_len: int, kv_len: int, causal: bool, dtype: torch.dtype
) -> torch.Tensor:
    """``mask`` (``None``, boolean or additive in ``dtype``) with every query kept to the keys of its own
    document (``starts``: :func:`packing.document_starts`), and causal where ``causal`` (a ``None`` mask
    meant causality). Boolean unless ``mask`` is additive; masked entries of an additive one are ``finfo.min``.
    """
    allowed = same_document(starts, q_len, kv_len)  # (B|1, 1, q, kv)
    if causal:
        allowed = allowed & torch.ones(q_len, kv_len, dtype=torch.bool, device=starts.device).tril()
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return allowed & mask
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


class MaskCache:
    """The merged mask of the fixed-slope forms, built once per forward and reused by every layer.

    One per converted model (every ``AlibiBias`` of the model holds the same one). Every layer has
    the same heads and fixed slopes, and transformers hands all of its layers the same mask object,
    so the merged mask (bias + padding + causality) only depends on (kind, heads, q_len, kv_len,
    device, dtype) and on that mask object. Models that mix sliding-window and full layers get one
    mask object per layer kind from transformers: one merged mask each (``MAX_ENTRIES`` at most), so
    alternating layers reuse theirs instead of rebuilding it per layer. The entries are kept per
    thread, so two threads running the same model never see each other's masks; :meth:`release` (at the end of
    the converted model's forward) drops the calling thread's entries when the forward ends. The learned form is
    never shared: its slopes differ per layer and carry gradients.

    While ``torch.compile`` or ``torch.export`` traces, the cache is not used at all (:func:`bias_mask`
    builds the mask per layer, :meth:`release` does nothing): dynamo cannot trace ``threading`` calls
    (a graph break, an error under ``fullgraph=True``), and a traced graph is one function of its inputs,
    shared by every thread that runs it, so there is nothing per thread to keep apart. The compiler's
    common-subexpression pass (aot_autograd's CSE) merges the identical per-layer builds again.

    Copies (``copy.deepcopy``, pickling) start empty.
    """

    DECODING_ROW = 1024  # the first decoding row's keys (then doubled as needed)
    MAX_ENTRIES = 4  # per thread and forward: transformers makes one mask per layer kind (full, sliding, chunked)

    def __init__(self):
        # thread id -> {(key, id of transformers' mask it was made from): (that mask, merged mask)}, newest last;
        # the entry holds the mask it was made from, so its id cannot be reused while the entry lives
        self._entries: dict[int, dict[tuple, tuple]] = {}
        # thread id -> (row starts (B,) or None, the sequence's end or None): set per forward for sinks
        self._rows: dict[int, tuple] = {}
        # thread id -> each token's document start (B|1, L) in a packed row: set per forward (packing.py)
        self._documents: dict[int, torch.Tensor] = {}
        self._traced_documents: torch.Tensor | None = None  # the same while torch.compile / export traces
        self._traced_rows: tuple = (None, None)  # the rows (``set_rows``) while torch.compile / export traces
        # thread id -> the continuous-batching layout of this forward (batching.PagedBatch): set per forward
        self._paged: dict[int, object] = {}
        # (slopes, device) -> the causal bias of one query over the latest keys, fp32 (1, H, 1, n): decoding steps
        # read its last kv_len keys (a view), n grows by doubling; shared by every thread, replaced whole
        self._decoding_rows: dict[tuple, torch.Tensor] = {}
        self.builds = 0  # how many masks were built (tests count them)

    def __deepcopy__(self, memo) -> MaskCache:
        return MaskCache()  # deepcopy's memo keeps one new cache per copied model

    def __getstate__(self) -> dict:
        return {"builds": 0}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    @property
    def merged(self) -> torch.Tensor | None:
        """The calling thread's current merged mask, if any."""
        entries = self._entries.get(threading.get_ident())
        return next(reversed(entries.values()))[1] if entries else None

    def get(self, alibi, query: torch.Tensor, kv_len: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The merged mask (bias + transformers' mask + the packed row's documents) for this layer's call."""
        return self._cached(_key(alibi, query, kv_len), attention_mask, _merged, alibi, query, kv_len, attention_mask)

    def reuse(self, alibi, query: torch.Tensor, kv_len: int, attention_mask) -> torch.Tensor | None:
        """The merged mask an earlier layer of this forward made for a call like this one (the same bias, path
        setting, shapes and transformers' mask), else ``None``. Only the bias path stores one here, so a hit means
        that layer chose it, and this one would too (decoding steps: the layers after the first run without
        choosing again). Never while traced (nothing is stored then, and dynamo cannot trace ``threading``)."""
        if alibi.sharing is None or is_exporting():
            return None
        entries = self._entries.get(threading.get_ident())
        if not entries:
            return None
        hit = entries.get((_key(alibi, query, kv_len), id(attention_mask)))
        return None if hit is None else hit[1]

    def packed(self, query: torch.Tensor, kv_len: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The causal mask of the recorded packed row, with transformers' mask (the fold's mask there)."""
        key = ("documents", query.shape[2], kv_len, query.device, query.dtype, torch.is_inference_mode_enabled())
        starts = self.documents()
        return self._cached(
            key, attention_mask, separate_documents, attention_mask, starts, query.shape[2], kv_len, True, query.dtype
        )

    def _cached(self, key: tuple, attention_mask, build, *args) -> torch.Tensor:
        # the calling thread's entry for (key, transformers' mask), else build(*args) stored there
        thread = threading.get_ident()
        entries = self._entries.get(thread)
        if entries is None:
            entries = self._entries[thread] = {}  # only this thread touches its entries
        entry_key = (key, id(attention_mask))
        hit = entries.get(entry_key)
        if hit is not None:
            return hit[1]
        merged = build(*args)
        self.builds += 1
        if len(entries) >= self.MAX_ENTRIES:
            del entries[next(iter(entries))]  # the oldest
        entries[entry_key] = (attention_mask, merged)
        return merged

    def decoding_row(self, alibi, kv_len: int, device: torch.device) -> torch.Tensor:
        """A decoding step's causal bias (``alibi``'s fixed slopes), fp32 ``(1, H, 1, kv_len)``: the last ``kv_len``
        keys of one row kept per slopes and device, a view (no bias built per step). The row is
        :func:`slopes.alibi_bias` for one query over its keys; its last ``kv_len`` are the same values."""
        row = self._decoding_rows.get((alibi.slope_values, device))
        if row is None or row.shape[-1] < kv_len:
            size = max(kv_len, 2 * row.shape[-1] if row is not None else self.DECODING_ROW)
            with torch.inference_mode(False):  # an inference tensor could not be saved for a later grad-mode backward
                row = alibi_bias(CAUSAL, 1, size, alibi.fixed_slopes(device))
            self._decoding_rows[(alibi.slope_values, device)] = row
        return row[..., row.shape[-1] - kv_len :]

    def set_rows(self, starts: torch.Tensor | None, end: int | None) -> None:
        """Where each row's real tokens start (``(B,)``, ``None``: 0) and the sequence's end position
        (``None``: the layer's key count) for the calling thread's forward: what sinks are placed by.

        While traced, one attribute instead of the per-thread table, as :meth:`set_documents` (dynamo cannot
        trace ``threading``: ``torch.compile(fullgraph=True)`` of a model with sinks stopped here)."""
        if is_exporting():
            self._traced_rows = (starts, end)
        else:
            self._rows[threading.get_ident()] = (starts, end)

    def rows(self) -> tuple[torch.Tensor | None, int | None]:
        """What :meth:`set_rows` recorded for the calling thread's forward (traced: by the trace's own forward),
        else ``(None, None)``."""
        if is_exporting():
            return self._traced_rows
        return self._rows.get(threading.get_ident(), (None, None))

    def set_documents(self, starts: torch.Tensor | None) -> None:
        """Each token's document start in the calling thread's packed forward (``None``: not packed).

        While traced, one attribute instead of the per-thread table (dynamo cannot trace ``threading``; a
        traced graph takes the starts as one of its own values, shared by no other call)."""
        if is_exporting():
            self._traced_documents = starts
        elif starts is None:
            self._documents.pop(threading.get_ident(), None)
        else:
            self._documents[threading.get_ident()] = starts

    def documents(self) -> torch.Tensor | None:
        """What :meth:`set_documents` recorded for the calling thread's forward (traced: what was recorded
        by the trace's own forward)."""
        if is_exporting():
            return self._traced_documents
        return self._documents.get(threading.get_ident())

    def begin(self, documents: torch.Tensor | None, batch) -> None:
        """The calling thread's forward, not traced (``conversion.before_forward``, before every forward): each
        token's document start in a packed row (as :meth:`set_documents`; ``None``: not packed), and whether it is
        a continuous-batching step (``batching.PagedBatch``, else ``None``)."""
        thread = threading.get_ident()
        for table, value in ((self._documents, documents), (self._paged, batch)):
            if value is None:
                table.pop(thread, None)
            else:
                table[thread] = value

    def paged(self):
        """The continuous-batching layout :meth:`begin` recorded for the calling thread's forward, else ``None``."""
        if not self._paged or is_exporting():  # traced: never a continuous-batching step (batching.py refuses it)
            return None
        return self._paged.get(threading.get_ident())

    def paged_mask(self, key: tuple, cu_seq_lens_k: torch.Tensor, build) -> torch.Tensor:
        """A continuous-batching step's merged mask, built once per layer kind (``key``) and forward: the layers of
        one kind get the same ``cu_seq_lens_k`` tensor from transformers' paged cache."""
        return self._cached(("paged", *key), cu_seq_lens_k, build)

    def release(self, *_args, **_kwargs) -> None:
        """Drop the calling thread's masks (the forward they were made for has ended)."""
        if is_exporting():  # traced: nothing was cached (see the class), and dynamo cannot trace threading
            self._traced_documents, self._traced_rows = None, (None, None)
            return
        thread = threading.get_ident()
        for table in (self._entries, self._rows, self._documents, self._paged):
            table.pop(thread, None)


def _key(alibi, query: torch.Tensor, kv_len: int) -> tuple:
    # What a merged mask depends on besides transformers' mask: layers share one where they share the form, slopes
    # and path setting (``alibi.sharing``; a layer forced elsewhere chooses on its own) and the query's shape, device
    # and dtype. Inference-mode tensors cannot be saved for backward: never hand one to a grad-mode call.
    return (alibi.sharing, query.shape, kv_len, query.device, query.dtype, torch.is_inference_mode_enabled())


def _merged(alibi, query: torch.Tensor, kv_len: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
    dtype, q_len = query.dtype, query.shape[2]
    bias = alibi(q_len, kv_len, query.device, torch.finfo(dtype).min)  # (1 or B, H, q, kv) fp32
    merged = merge_bias_and_mask(bias, attention_mask, dtype)
    starts = alibi.masks.documents()
    if starts is not None:  # a packed row: each query sees its own document (the bias holds causality)
        merged = separate_documents(merged, starts, q_len, kv_len, False, dtype)
    return merged


def bias_mask(alibi, query: torch.Tensor, kv_len: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Bias + transformers' mask (+ a packed row's documents) as one additive float mask in the query's dtype,
    ``(1 or B, H, q, kv)``.

    Shared through the model's :class:`MaskCache` in eager mode; built here per layer for the learned
    form (its own slopes) and while torch.compile / torch.export traces (no cache in a graph).
    """
    if alibi.kind == LEARNED or is_exporting():
        return _merged(alibi, query, kv_len, attention_mask)
    return alibi.masks.get(alibi, query, kv_len, attention_mask)


def packed_causal_mask(masks: MaskCache, query: torch.Tensor, kv_len: int, attention_mask) -> torch.Tensor | None:
    """The fold's mask: transformers' mask, or with a packed row recorded (``masks.documents()``) that mask
    kept causal inside each document (boolean, or additive where transformers' is); shared per forward."""
    starts = masks.documents()
    if starts is None:
        return attention_mask
    if is_exporting():
        return separate_documents(attention_mask, starts, query.shape[2], kv_len, True, query.dtype)
    return masks.packed(query, kv_len, attention_mask)
