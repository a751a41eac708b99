"""Continuous batching: transformers' ``generate_batch`` / ``init_continuous_batching`` (and ``transformers serve
--continuous-batching``) with the bias carried through its paged KV cache.

A continuous-batching step is one flattened row: every running request's new tokens one after another, with
``position_ids`` per token, ``cu_seq_lens_q`` (where each request's queries start) and, per layer, the keys that
the ``PagedAttentionCache`` gathered for each request in position order, ending with its new tokens
(``cu_seq_lens_k``; a sliding layer gets at most ``window - 1`` cached keys before the new ones). The bias of head
``h`` between a query and a key of the same request is ``-m_h * (q_pos - k_pos)``, where the query's position is
its position id and a key's is counted back from its request's last new token; keys of other requests, keys after
the query and (on a sliding layer) keys a window or more behind are masked; sinks (the first ``sinks`` positions of
each request) carry no bias. The mask is built here from those tensors, once per forward and layer kind, and
handed to the eager or sdpa kernel: transformers' paged path never runs its own attention on a converted model.

transformers' manager checks the attention implementation's name (``"sdpa"``, ``"paged|eager"`` or flash) and
would switch a model to flash by itself; a converted model reports ``alibi_<backend>`` and makes its manager
with :func:`alibi_manager_class`, whose check accepts the eager and sdpa backends with their ALiBi path and
refuses the rest in one line. With that name transformers builds no mask of its own (it would be its plain one).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .compat import (
    CONTINUOUS_BATCHING_DENSE_MASK_NAMES,
    attn_implementation,
    cached_continuous_batching_manager,
    continuous_batching_manager_class,
    is_paged_cache,
    paged_layer_window,
    store_attn_implementation,
    stored_attn_implementation,
)
from .kernels import PAGED_BACKENDS, check_backend, paged_refusal
from .names import alibi_name, base_name
from .slopes import CAUSAL, BiasSpec, is_sink

# What continuous batching passes a model's forward for its layers: each layer's ``cache.update(key, value,
# layer_idx, kwargs)`` narrows the per-kind entries (cu_seq_lens_k, max_length_k) to its own and reads the indices
LAYER_ARGUMENTS = (
    "cu_seq_lens_q", "max_length_q", "cu_seq_lens_k", "max_length_k", "read_index", "write_index", "block_table",
)  # fmt: skip


@dataclass(frozen=True)
class PagedBatch:
    """One continuous-batching forward's layout: the paged cache, each request's first query (``cu_seq_lens_q``,
    ``(R + 1,)``), each token's position in its request (``(Q,)``) and the forward's :data:`LAYER_ARGUMENTS` (read
    by layers that the model's own forward does not hand them to: BLOOM, MPT, Falcon, ``hf_alibi/native/``)."""

    cache: object
    cu_seq_lens_q: torch.Tensor
    positions: torch.Tensor
    layer_arguments: dict = field(default_factory=dict, compare=False)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """A layer's keys and values written to the paged cache and read back with its request's cached ones, ``(1,
        H, kv, d)`` each, and the keyword arguments of its attention call (this layer's ``cu_seq_lens_k``, ...)."""
        arguments = dict(self.layer_arguments)  # the cache narrows the per-kind entries in place
        key, value = self.cache.update(key, value, layer_idx, arguments)
        return key, value, arguments


def paged_batch(cache, kwargs: dict) -> PagedBatch | None:
    """The layout of a forward whose ``cache`` is transformers' ``PagedAttentionCache``, else ``None``."""
    if cache is None or not is_paged_cache(cache):
        return None
    cu_seq_lens_q, positions = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")
    if cu_seq_lens_q is None or positions is None:
        raise ValueError(
            "A forward with a PagedAttentionCache needs cu_seq_lens_q and position_ids (what transformers' continuous "
            "batching passes): run the model through generate_batch or init_continuous_batching."
        )
    arguments = {name: kwargs[name] for name in LAYER_ARGUMENTS if name in kwargs}
    return PagedBatch(cache, cu_seq_lens_q, positions.reshape(-1), arguments)


def paged_bias(
    spec: BiasSpec,
    positions: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    kv_len: int,
    window: int | None,
    masked_value: float,
) -> torch.Tensor:
    """The causal ALiBi bias ``spec`` (its slopes, sinks and rounding) with continuous batching's mask, fp32
    ``(1, H, Q, kv_len)`` on the device of ``positions``.

    Query ``i`` is at ``positions[i]`` in request ``r`` (``cu_seq_lens_q[r] <= i < cu_seq_lens_q[r + 1]``); the keys
    ``cu_seq_lens_k[r] <= j < cu_seq_lens_k[r + 1]`` are request ``r``'s, in position order, the last one at the
    request's last query. Tokens past the last request (padding) see nothing.

    >>> paged_bias(BiasSpec("causal", (1.0,)), torch.tensor([2, 0, 1]), torch.tensor([0, 1, 3]),
    ...            torch.tensor([0, 3, 5]), 5, None, float("-inf"))[0, 0]
    tensor([[-2., -1., -0., -inf, -inf],
            [-inf, -inf, -inf, -0., -inf],
            [-inf, -inf, -inf, -1., -0.]])
    """
    device = positions.device
    slopes = torch.tensor(spec.slopes, dtype=torch.float32, device=device)  # once per step and layer kind
    sinks, rounding = spec.sinks, spec.rounding
    cu_q, cu_k = cu_seq_lens_q.to(device=device, dtype=positions.dtype), cu_seq_lens_k.to(device, positions.dtype)
    q_len = positions.numel()
    q_index = torch.arange(q_len, device=device, dtype=cu_q.dtype)
    q_request = torch.searchsorted(cu_q[1:], q_index, right=True)  # (Q,); R for padding past the last request
    # request r's keys are consecutive positions ending with its queries: query i is key cu_k[r + 1] - cu_q[r + 1] + i
    # and sees back to the request's first key cu_k[r] (or the window); padding queries see nothing (first key K)
    last = torch.cat([cu_k[1:] - cu_q[1:], cu_k.new_zeros(1)])[q_request] + q_index
    first = torch.cat([cu_k[:-1], cu_k.new_full((1,), kv_len)])[q_request]
    if window is not None:
        first = torch.maximum(first, last - (window - 1))
    k_index = torch.arange(kv_len, device=device, dtype=cu_k.dtype)
    distance = last[:, None] - k_index  # (Q, K): q_pos - k_pos within a request
    allowed = (distance >= 0) & (k_index >= first[:, None])
    if rounding is None:
        bias = distance.float() * -slopes.float()[:, None, None]  # (H, Q, K)
    else:  # t(p_j) - t(p_i), positions in the request (KeyRounding)
        keys = rounding.terms(slopes, (positions[:, None] - distance).float())  # (H, Q, K)
        bias = keys - rounding.terms(slopes, positions.float())[:, :, None]
    if sinks:  # key position in its request = query position - distance; each request starts at 0
        bias = bias.masked_fill(is_sink(positions[:, None] - distance, 0, sinks)[None], 0.0)
    return torch.where(allowed, bias, masked_value).unsqueeze(0)


def paged_bias_mask(forward, alibi, module, query: torch.Tensor, kv_len: int, kwargs: dict) -> torch.Tensor:
    """This layer's bias and mask as one additive mask in the query's dtype, ``(1, H, Q, kv_len)``, shared by the
    layers of one kind (window, slopes) for the forward (``forward``, whose ``paged`` layout this step is)."""
    batch = forward.paged
    if alibi.kind != CAUSAL:
        raise ValueError(f"Continuous batching runs decoders (a causal bias); this layer's bias is {alibi.kind!r}.")
    if kwargs.get("block_table") is not None:
        raise ValueError(
            "Continuous batching's decode fast path (a block table read by flash kernels) has no ALiBi path: "
            f"use attn_implementation {' or '.join(repr(name) for name in PAGED_BACKENDS)} for continuous batching."
        )
    cu_seq_lens_k = kwargs.get("cu_seq_lens_k")
    if not isinstance(cu_seq_lens_k, torch.Tensor):
        raise ValueError("A continuous-batching attention call came without its layer's cu_seq_lens_k.")
    window = paged_layer_window(batch.cache, module.layer_idx)
    dtype = query.dtype
    key = (window, alibi.spec, query.shape[2], kv_len, query.device, dtype)  # the bias as one value: its spec

    def build() -> torch.Tensor:
        positions = batch.positions.to(query.device)
        bias = paged_bias(
            alibi.spec, positions, batch.cu_seq_lens_q, cu_seq_lens_k, kv_len, window, torch.finfo(dtype).min
        )
        return bias.to(dtype)

    # the layers of one kind get the same cu_seq_lens_k tensor from transformers' paged cache
    return forward.cached(("paged", *key), cu_seq_lens_k, build)


def check_continuous_batching(model) -> None:
    """One-line ``ValueError`` where a converted model cannot carry its bias through continuous batching."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("Continuous batching runs decoder-only models; use generate() for this encoder-decoder.")
    check_backend(stored_attn_implementation(config))  # another engine's name, written past the setter
    reason = paged_refusal(attn_implementation(config))  # the kernel table's paged backends take the bias here
    if reason is not None:
        raise ValueError(reason)


def check_manager_config(continuous_batching_config) -> None:
    """One-line ``ValueError`` for what the paged ALiBi path was not built for: compiled steps, CUDA graphs."""
    if continuous_batching_config.varlen_compile_config is not None or (
        continuous_batching_config.decode_compile_config is not None
    ):
        raise ValueError(
            "Continuous batching with torch.compile has no ALiBi path yet: leave ContinuousBatchingConfig's "
            "varlen_compile_config, decode_compile_config and default_compile_level unset."
        )
    if any(continuous_batching_config.cuda_graph_booleans):
        raise ValueError(
            "Continuous batching with CUDA graphs has no ALiBi path yet: pass "
            "ContinuousBatchingConfig(use_cuda_graph=False)."
        )


_MANAGER_CLASS: list[type] = []


def alibi_manager_class() -> type:
    """transformers' ``ContinuousBatchingManager`` with hf_alibi's check of the attention name (made once)."""
    if _MANAGER_CLASS:
        return _MANAGER_CLASS[0]
    base = continuous_batching_manager_class()

    class AlibiContinuousBatchingManager(base):
        """Continuous batching for a converted model: its ``alibi_sdpa`` / ``alibi_eager`` attention takes the paged
        layout itself (``batching.py``); any other backend, compiled steps and CUDA graphs are refused in one line."""

        def __init__(self, model, *args, **kwargs):
            super().__init__(model, *args, **kwargs)
            check_manager_config(self.continuous_batching_config)

        @contextlib.contextmanager
        def making_batch_processor(self):
            # a model trained with ALiBi keeps the name "sdpa" (native/), for which transformers would allocate a
            # dense mask of GBs that the paged path never reads: the processor is made under hf_alibi's name for it
            config = self.model.config
            name = attn_implementation(config)
            if name not in CONTINUOUS_BATCHING_DENSE_MASK_NAMES:
                yield
                return
            store_attn_implementation(config, alibi_name(base_name(name)))
            try:
                yield
            finally:
                store_attn_implementation(config, name)

        def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
            # transformers' version accepts only the plain names and may switch the model to flash by itself: the
            # converted model keeps its backend (its ALiBi path reads the paged layout), or is refused
            check_continuous_batching(model)

    _MANAGER_CLASS.append(AlibiContinuousBatchingManager)
    return AlibiContinuousBatchingManager


def make_manager(model, generation_config=None, continuous_batching_config=None, workload_hints=None):
    """What ``ContinuousMixin.init_continuous_batching`` does (transformers 5.24.0), with the manager of
    :func:`alibi_manager_class`: reuse a cached manager, else check the generation config and make one."""
    from transformers import ContinuousBatchingConfig

    check_continuous_batching(model)
    cached = cached_continuous_batching_manager(model)
    if isinstance(cached, alibi_manager_class()):
        cached.switch_to_cb_friendly_attn(model)
        return cached
    generation_config = generation_config if generation_config is not None else model.generation_config
    if generation_config is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    if generation_config.eos_token_id is None:
        generation_config.eos_token_id = -1  # transformers' own default: no end-of-sequence token
    if continuous_batching_config is None:
        continuous_batching_config = getattr(generation_config, "continuous_batching_config", None)
        if not isinstance(continuous_batching_config, ContinuousBatchingConfig):
            continuous_batching_config = ContinuousBatchingConfig()
    return alibi_manager_class()(
        model=model,
        generation_config=generation_config,
        continuous_batching_config=continuous_batching_config,
        workload_hints=workload_hints,
    )
