"""``alibi_<backend>``: ALiBi attention registered with transformers' attention interface, and the path choice.

A converted model's config reports the attention implementation ``"alibi_<backend>"`` (see
``config.py``), so transformers dispatches each attention layer to the function registered here
under that name. The function finds the layer's :class:`AlibiBias` (``module.alibi``), chooses how
to apply it (:func:`choose_path`) and calls the backend. A layer without an ``AlibiBias``
(cross-attention) runs transformers' backend unchanged: no position bias, as in T5.

Registering new names is all that happens: no transformers function is replaced. Loaded as
hf_alibi's core the names are ``alibi_<backend>``; loaded from a checkpoint's remote code they are
``alibi_remote_<backend>``, so a checkpoint's copy never replaces the installed library's functions.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .batching import paged_bias_mask
from .bias import AUTO, BIAS, FOLDED, PATHS, AlibiBias
from .compat import base_mask_function, is_exporting, stored_attn_implementation, update_paged_cache_in_attention
from .denormals import bracket, flushed
from .folded import folded_causal_attention, folded_unavailable
from .forward import forward_of
from .kernels import (
    KERNELS,
    MERGED,
    PADDING,
    RUNNING_BACKENDS,
    WHAT_RUNS,
    check_backend,
    paged_refusal,
    window_refusal,
)
from .mask import bias_mask, packed_causal_mask, shared_mask
from .names import FOREIGN, alibi_name
from .slopes import CAUSAL
from .window import WINDOW, window_attention

# Below this many queries (decoding, small chunks) "auto" takes the bias path: its tensor is only
# H x q x kv there, while the fold would copy the whole K/V cache once more per layer and step.
FOLD_MIN_QUERIES = 32
# On CUDA "auto" keeps the bias path while the batch's q x kv scores a head number at most this: measured on an H200
# (bf16, 12 layers of 12 heads, GPT-2 and Llama shapes; docs/performance.md). At batch 1 the bias path's training step
# took 0.80-0.94 of the fold's at 1k and 4k tokens and 1.9x it at 16k. One attention call timed apart: the bias
# tensor's kernel (the memory-efficient one, the mask read for every row of the batch) grows with the batch where the
# fold's cuDNN kernel, underused at batch 1, grows less: at 4k tokens 0.84 against 1.34 ms at batch 1, 5.76 against
# 3.86 at batch 8; at 1k and batch 8 (as many scores as 4k at batch 2) the bias still leads, 0.60 against 1.23
CUDA_BIAS_MAX_SCORES = 4096 * 4096
# fewer queries than this run without the flush: measured on an Intel Xeon with slow subnormals (5x in the training
# kernel), one decoding query against 64 to 8192 keys took no longer unflushed, and the flush adds 10-25 us a call
FLUSH_MIN_QUERIES = 32
# Forces a path for every AlibiBias whose own ``path`` is left at "auto" (e.g. HF_ALIBI_PATH=bias).
PATH_ENV = "HF_ALIBI_PATH"


def path_setting() -> str:
    """``HF_ALIBI_PATH`` as set now (``"auto"`` if unset or empty). Read where a layer chooses its path: once per
    decoding step (the first layer; the others reuse its choice), about 1-2 us against a step's milliseconds."""
    return os.environ.get(PATH_ENV) or AUTO


def cuda_prefers_bias(device_type: str, q_len: int, kv_len: int, batch: int = 1) -> bool:
    """Whether "auto" takes the bias path on this device for ``batch`` rows of ``q_len`` queries against ``kv_len``
    keys because it is faster there than the fold (CUDA, up to ``CUDA_BIAS_MAX_SCORES`` scores a head over the batch),
    measured, not by construction."""
    return device_type == "cuda" and batch * q_len * kv_len <= CUDA_BIAS_MAX_SCORES


def choose_path(
    alibi: AlibiBias, backend: str, query: torch.Tensor, attention_mask, kwargs: dict, kv_len: int | None = None
) -> str:
    """The path this call takes: ``"folded"`` where it is exact and pays, else ``"bias"``.

    "auto" folds causal sdpa attention of at least ``FOLD_MIN_QUERIES`` queries in fp32, fp64,
    bf16 and fp16 (half precision on CPU and CUDA, where SDPA accumulates q.k in fp32), with or
    without a padding mask, at any cache offset; decoding steps and small chunks take the bias path
    (an H x q x kv tensor, cheaper there than copying K and V). Measured on CPU (README,
    Performance): the fold (row construction) costs 0.96 to 1.04 of the unpatched model's training
    step in bf16 and fp32 where the bias path costs up to 2x; with a mask (channel construction) it
    is below the bias path from 256 queries and within noise of it at 32 to 128; it never builds an
    L x L tensor. On CUDA (H200, docs/performance.md) the bias path is the faster of the two up to
    ``CUDA_BIAS_MAX_SCORES`` scores a head over the batch (``kv_len``, the keys, default the queries), the fold
    beyond it (on cuDNN, ``folded.fold_construction``). While ``torch.export`` or ``torch.compile`` traces, the
    query count is not looked at (it would become a guard that rejects other lengths): the fold is taken wherever it
    is exact.

    ``alibi.path`` (or ``HF_ALIBI_PATH`` when it is ``"auto"``) forces one; forcing ``"folded"``
    where it would be wrong raises instead of computing something else.
    """
    wanted = alibi.path
    if wanted == AUTO:
        wanted = path_setting()
        if wanted not in PATHS:
            raise ValueError(f"{PATH_ENV}={wanted!r}; expected one of {PATHS}.")
    if wanted == BIAS:
        return BIAS
    if wanted == AUTO and not is_exporting():
        q_len = query.shape[2]
        if q_len < FOLD_MIN_QUERIES:
            return BIAS  # a few queries (decoding): the bias is small there, and this is the hot loop
        if cuda_prefers_bias(query.device.type, q_len, q_len if kv_len is None else kv_len, query.shape[0]):
            return BIAS
    if backend != "sdpa":
        reason = f"only the sdpa backend has it, not {backend!r}"
    else:
        reason = folded_unavailable(alibi, query, attention_mask, kwargs)
    if reason is None:
        return FOLDED
    if wanted == FOLDED:
        raise ValueError(
            f"The folded ALiBi path was forced but cannot run here: {reason}. "
            f"Set layer.alibi.path (or {PATH_ENV}) to 'auto' or 'bias'."
        )
    return BIAS


def make_alibi_attention(backend_name: str, backend: Callable, plain_backend: Callable) -> Callable:
    """Wrap a mask-taking backend (eager, sdpa) so that it applies the layer's ALiBi bias: ``backend`` takes the
    merged float mask; layers without ALiBi (cross-attention) run ``plain_backend`` with transformers' mask."""

    def alibi_attention_forward(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs,
    ):
        # the hot loop of generation runs this once per layer and token: the common case comes first, in few steps
        alibi: AlibiBias | None = module._modules.get("alibi")  # the submodule (no nn.Module.__getattr__ call)
        forward = forward_of(alibi, kwargs)  # this forward, as the model passed it down (out of kwargs)
        if alibi is None:  # cross-attention: no position bias
            return plain_backend(module, query, key, value, attention_mask, **kwargs)
        if forward.paged is not None:  # a continuous-batching step (before transformers 5.24: the cache written here)
            key, value = update_paged_cache_in_attention(module, key, value, kwargs)
        if alibi.window is not None and _past_the_window(forward, alibi, key.shape[2]):  # window.py
            return _window(forward, alibi, module, query, key, value, attention_mask, kwargs)
        # a decoding step's layers after the first: the first one's choice (the bias path) and its mask
        mask = shared_mask(forward, alibi, query, key.shape[2], attention_mask)
        if mask is None:
            return _choose_and_run(
                backend_name, backend, forward, alibi, module, query, key, value, attention_mask, kwargs
            )
        if alibi.last_path != BIAS:  # nn.Module's __setattr__ is slow: set only on a change
            alibi.last_path = BIAS
        flush = query.shape[2] >= FLUSH_MIN_QUERIES  # what _flushes says (not traced here: reuse answers nothing then)
        return _with_bias_mask(backend, module, query, key, value, mask, kwargs, flush)

    return alibi_attention_forward


def _choose_and_run(
    backend_name: str, backend: Callable, forward, alibi: AlibiBias, module, query, key, value, attention_mask, kwargs
):
    # the first layer of a forward (or every layer where nothing is shared): choose the path and run it
    alibi.check_heads(query)
    if forward.paged is not None:  # a continuous-batching step: the bias follows each request (batching.py)
        alibi.last_path = BIAS
        mask = paged_bias_mask(forward, alibi, module, query, key.shape[2], kwargs)
        return _with_bias_mask(backend, module, query, key, value, mask, kwargs, _flushes(query))
    path = choose_path(alibi, backend_name, query, attention_mask, kwargs, key.shape[2])
    if alibi.last_path != path:  # nn.Module's __setattr__ is slow: set only on a change
        alibi.last_path = path
    if path == FOLDED:
        attention_mask = packed_causal_mask(forward, query, key.shape[2], attention_mask)
        run = partial(
            folded_causal_attention, module, attention_mask=attention_mask,
            slopes=alibi.fixed_slopes(query.device), dropout=kwargs.get("dropout", 0.0),
            scaling=kwargs.get("scaling"), bias=alibi.spec, rows=forward.rows(alibi),
        )  # fmt: skip
        return _flushed_kernel(run, query, key, value)
    q_len = query.shape[2]
    if backend_name == "sdpa" and alibi.kind == CAUSAL and attention_mask is None and 1 < q_len < key.shape[2]:
        # transformers' sdpa gives no mask here only when top-left alignment is right (prefill into an empty
        # static cache) and then cuts the keys to the queries: do the same.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    mask = bias_mask(forward, alibi, query, key.shape[2], attention_mask)
    return _with_bias_mask(backend, module, query, key, value, mask, kwargs, _flushes(query))


def _past_the_window(forward, alibi: AlibiBias, kv_len: int) -> bool:
    # whether this call's keys reach past the layer's rotary window; a continuous-batching step that does is refused
    # (its requests share one paged layout): its longest request counts, not the pages' slots
    if forward.paged is None:
        return kv_len > alibi.window.size
    longest = int(forward.paged.positions.max()) + 1
    reason = window_refusal(alibi, longest, "Continuous batching", "generate() (one batch, no paged cache)")
    if reason is not None:
        raise ValueError(reason)
    return False


def _window(forward, alibi: AlibiBias, module, query, key, value, attention_mask, kwargs):
    # far pairs read their own rotation: one computation carries it on eager and sdpa alike (window.py)
    alibi.check_heads(query)
    if alibi.last_path != WINDOW:
        alibi.last_path = WINDOW
    dropout = kwargs.get("dropout", 0.0) if module.training else 0.0
    scaling = kwargs.get("scaling")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return window_attention(module, query, key, value, attention_mask, alibi, forward, scaling, dropout)


def _with_bias_mask(backend: Callable, module, query, key, value, mask: torch.Tensor, kwargs: dict, flush: bool):
    # the mask-taking backend (eager, sdpa) with the bias merged into its mask: causality is in the mask now (the
    # backends take none of transformers' is_causal or position_bias). ``flush``: what _flushes says of this call
    if not flush:  # decoding steps: called directly, the fewest steps
        return backend(module, query, key, value, mask, **kwargs)
    run = partial(backend, module, attention_mask=mask, **kwargs)
    return _flushed_kernel(run, query, key, value)


def _flushes(query: torch.Tensor) -> bool:
    # flush-to-zero on the CPU kernel (denormals.py): ALiBi's far keys would otherwise make it compute subnormal
    # weights, which many CPUs do in microcode. Not for decoding steps and small chunks, where the flush's set and
    # restore cost more than the subnormals (docs/performance.md), nor while traced (no guard on the query count)
    return not is_exporting() and query.shape[2] >= FLUSH_MIN_QUERIES  # in this order: no guard on the length


def _flushed_kernel(run: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    # the kernel, forward and backward, flushed where _flushes says so
    if not _flushes(query):
        return run(query, key, value)
    query, key, value, close = bracket(query, key, value)
    with flushed(query):
        output, weights = run(query, key, value)
    return close(output), weights


def make_native_attention(alibi_backend: Callable, plain_backend_name: str) -> Callable:
    """A backend that applies the bias itself (flex, flash); layers without ALiBi run transformers' own."""

    def attention_forward(module, query, key, value, attention_mask, **kwargs):
        alibi = getattr(module, "alibi", None)
        forward = forward_of(alibi, kwargs)  # out of kwargs: transformers' kernels never see it
        if alibi is None:  # cross-attention: no position bias
            return ALL_ATTENTION_FUNCTIONS[plain_backend_name](module, query, key, value, attention_mask, **kwargs)
        if forward.paged is not None:  # the manager refuses these backends; switched to one while it ran
            raise ValueError(paged_refusal(plain_backend_name))
        return alibi_backend(module, query, key, value, attention_mask, forward=forward, **kwargs)

    return attention_forward


def _refuse_foreign(config) -> None:
    # the model's config holds a name no hf_alibi path knows (an engine wrote it past the setter): refuse it
    check_backend(stored_attn_implementation(config))
    raise ValueError(f"This ALiBi model has no attention implementation it can run. Instead, {WHAT_RUNS}.")


def _foreign_backend(module, *args, **kwargs):
    _refuse_foreign(module.config)


def _foreign_mask(*args, config=None, **kwargs):
    _refuse_foreign(config)  # transformers makes the mask before the first attention layer runs


def _alibi_only(label: str, name: str) -> Callable:
    def forward(*args, **kwargs):
        raise ValueError(
            f"attn_implementation={name!r} is {label}, hf_alibi's kernel for ALiBi layers: this layer has no ALiBi "
            "(a model not converted by hf_alibi, or cross-attention): use model.set_attn_implementation('sdpa')."
        )

    return forward


def _unsupported_backend(name: str) -> Callable:
    def forward(*args, **kwargs):
        raise NotImplementedError(
            f"hf_alibi has no ALiBi path for attn_implementation={name!r} yet. "
            f"Use one of {sorted(RUNNING_BACKENDS)}: model.set_attn_implementation('sdpa')."
        )

    return forward


# each running row's function, imported from its file by the names its row gives (kernels.py): a new kernel needs no
# line here. Relative to this package, whatever its name: hf_alibi.core, or a checkpoint's copy under
# transformers_modules. The files are copied with a checkpoint by the import lines kernels.py carries for that
FUNCTIONS: dict[str, Callable] = {
    row.name: getattr(importlib.import_module(f".{row.module}", __package__), row.function)
    for row in KERNELS
    if row.runs
}
# what layers without ALiBi (cross-attention) run with a merged-mask kernel, with transformers' own mask:
# transformers' sdpa under its public name; for eager transformers shares no function (each model has its own), and
# dense.py's adds the additive float mask transformers makes for eager as the models' own functions do
PLAIN_BACKENDS: dict[str, Callable] = {"eager": FUNCTIONS["eager"], "sdpa": ALL_ATTENTION_FUNCTIONS["sdpa"]}


def register_backends() -> None:
    """Add ``alibi_<backend>`` to transformers' attention and mask interfaces for every row of the kernel table
    (idempotent): a merged-mask kernel wrapped with the bias, a kernel that renders the bias itself handed the
    layer's forward, a known but refused name a one-line error."""
    for row in KERNELS:
        name = row.name
        if not row.runs:
            AttentionInterface.register(alibi_name(name), _unsupported_backend(name))
        elif row.mask == MERGED:
            attention = make_alibi_attention(name, FUNCTIONS[name], PLAIN_BACKENDS[name])
            AttentionInterface.register(alibi_name(name), attention)
        else:
            AttentionInterface.register(alibi_name(name), make_native_attention(FUNCTIONS[name], name))
        mask = base_mask_function(name)
        if mask is None and row.mask == PADDING:  # a kernel transformers does not know (cudnn): its flash mask
            mask = base_mask_function("flash_attention_2")
        if mask is not None or row.mask == MERGED:
            AttentionMaskInterface.register(alibi_name(name), mask)
        if row.runs and name not in ALL_ATTENTION_FUNCTIONS.valid_keys() and name != "eager":
            # its plain name, so that transformers' setter and from_pretrained accept it for a converted model (whose
            # config reports alibi_<name>); a model without ALiBi, or a layer without it, is refused in one line
            AttentionInterface.register(name, _alibi_only(row.label, name))
            AttentionMaskInterface.register(name, mask)
    AttentionInterface.register(alibi_name(FOREIGN), _foreign_backend)
    AttentionMaskInterface.register(alibi_name(FOREIGN), _foreign_mask)
