"""Models trained with ALiBi (BLOOM, MPT, Falcon-RW), run on hf_alibi's attention paths.

transformers runs these three on their own attention code: eager only, a ``(B*H, q, kv)`` score tensor per layer,
MPT's bias built at ``max_seq_len`` (longer inputs crash). Nothing of them is converted here: every weight, the
config and its ``model_type`` stay as they are (``save_pretrained`` writes the original format). Only each
self-attention module changes, on this instance: its class becomes a subclass whose forward splits the fused QKV in
the model's layout, updates the cache and calls transformers' attention interface (``alibi_<backend>``), with an
:class:`~hf_alibi.core.bias.AlibiBias` carrying the model's own slopes. What differs between the three is data, a
:class:`NativeArchitecture` row (``hf_alibi.patches.native``): where the fused QKV is and how it is laid out, which
slopes, and whether the bias is added before the scaling (Falcon), which scales the slopes.

The package, by job: ``rows.py`` (a row, plain data), ``attention.py`` (the slopes, the attention module's forward,
the masks), ``model.py`` (the classes made per original class and row, pickling, what a model runs with),
``patching.py`` (the check and the patch). This ``__init__`` names them lazily (PEP 562): reading a row
(``hf_alibi.patches.native``, the command line) imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:  # the homes of the lazy names
    from .attention import NativeAlibiAttention, boolean_causal_mask, is_causal_mark, native_slopes  # noqa: F401
    from .model import SUPPORT_FLAGS, rendering_backends, what_runs  # noqa: F401
    from .patching import check_native, is_native, patch_native  # noqa: F401
    from .rows import BLOCKS, MPT, NATIVE, PAPER, PER_HEAD, NativeArchitecture  # noqa: F401

_HOMES = {
    **dict.fromkeys(["NativeAlibiAttention", "boolean_causal_mask", "is_causal_mark", "native_slopes"], "attention"),
    **dict.fromkeys(["SUPPORT_FLAGS", "rendering_backends", "what_runs"], "model"),
    **dict.fromkeys(["check_native", "is_native", "patch_native"], "patching"),
    **dict.fromkeys(["BLOCKS", "MPT", "NATIVE", "PAPER", "PER_HEAD", "NativeArchitecture"], "rows"),
}
__all__ = sorted(_HOMES)


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
