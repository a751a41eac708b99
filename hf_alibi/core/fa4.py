"""FlashAttention-4 (``flash-attn-4``, CuTe DSL kernels for Hopper and Blackwell) with an ALiBi ``score_mod``.

FA4 has no ``alibi_slopes``; it runs a ``score_mod(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors)`` on every
score after ``softmax_scale`` and before its causal mask (so the causal kernel still skips the tiles above the
diagonal), with ``q_idx`` and ``kv_idx`` counted within the sequence (a variable-length sequence's own, from 0), and
a ``score_mod_bwd`` in the backward pass. The slopes travel as an fp32 aux tensor ``(H,)`` read per head.

* causal: ``score - m_h (q_idx - kv_idx)``. FA4's causal mask is aligned to the bottom right (query ``i`` sees keys
  ``j <= i + Sk - Sq``), so with a KV cache (``Sk > Sq``) the true distance is ``q_idx + Sk - Sq - kv_idx``: the
  bias here differs from ``-m_h`` times it by ``m_h (Sk - Sq)``, the same for every key of a query's row, which
  softmax ignores. Left padding and packed rows run as variable-length sequences (``flash.in_flash_layout``): each
  sequence's indices start at its own first real token, so a row's padding or another document shifts nothing.
  ``q_idx - kv_idx`` rather than ``kv_idx`` alone keeps the added values small (exact distances in training,
  ``Sq == Sk``), so fp32 rounds them least.
* symmetric (bidirectional encoders): ``score - m_h |q_idx - kv_idx|``, exact where queries and keys are the same
  tokens (``Sq == Sk`` per sequence, as an encoder's self-attention is); other shapes are refused.

The bias is additive, so ``score_mod_bwd`` hands the gradient through unchanged. Sinks, a bias rounded per key
(Falcon), the nonsymmetric and learned forms, soft-capping (FA4 takes ``softcap`` or a ``score_mod``, not both) and
dropout (FA4 has none) are refused in one line. The kernels are found in one place (:func:`fa4_kernels`), where the
tests put a CPU stand-in written from FA4's documented contract (``tests/fa4_standin.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from .flash import in_flash_layout
from .forward import AlibiForward
from .kernels import kernel_refusal
from .slopes import CAUSAL

NAME = "flash_attention_4"
_FOUND: dict = {}  # the kernels and score_mods, made once (FA4 caches its compiled kernels by the score_mod's hash)


def causal_score(score, slope, q_idx, kv_idx, to_float):
    """The causal score_mod's arithmetic: the true distance less ``Sk - Sq``, a constant per row (see above)."""
    return score - slope * to_float(q_idx - kv_idx)


def symmetric_score(score, slope, q_idx, kv_idx, to_float, absolute):
    """The symmetric score_mod's arithmetic: ``-m |i - j|``."""
    return score - slope * to_float(absolute(q_idx - kv_idx))


def _score_mods(slope_of, to_float, absolute) -> dict:
    # form -> (score_mod, score_mod_bwd) in FA4's signature, the arithmetic above written once for CuTe and torch
    def causal_mod(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return causal_score(score, slope_of(h_idx, aux_tensors), q_idx, kv_idx, to_float)

    def symmetric_mod(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return symmetric_score(score, slope_of(h_idx, aux_tensors), q_idx, kv_idx, to_float, absolute)

    def additive_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad  # d(score + bias) / d(score) = 1

    return {"causal": (causal_mod, additive_bwd), "symmetric": (symmetric_mod, additive_bwd)}


def torch_score_mods() -> dict:
    """The score_mods on torch tensors (``aux_tensors[0]`` the slopes): what a CPU stand-in of FA4 evaluates, the
    same arithmetic as the CuTe ones."""
    return _score_mods(lambda h, aux: aux[0][h], lambda x: x.to(torch.float32), torch.abs)


def _cute_score_mods(cute, cutlass, mlir_math) -> dict:
    # a score_mod that reads aux tensors sees one score at a time (FA4's vec_size 1), and reads the tensor through a
    # one-element register tensor (FA4's own code makes them with make_rmem_tensor, its tests with make_fragment)
    registers = getattr(cute, "make_rmem_tensor", None) or cute.make_fragment

    def slope_of(h_idx, aux_tensors):
        head = registers(1, cutlass.Int32)
        head.store(h_idx)
        slope = registers(1, cutlass.Float32)
        slope[0] = aux_tensors[0][head[0]]
        return slope.load()

    def absolute(diff):
        return cute.TensorSSA(mlir_math.absi(diff), diff.shape, diff.dtype)

    mods = _score_mods(slope_of, lambda x: x.to(cutlass.Float32), absolute)
    return {form: tuple(cute.jit(mod) for mod in pair) for form, pair in mods.items()}


def fa4_kernels(device: torch.device) -> tuple:
    """FA4's ``(flash_attn_func, flash_attn_varlen_func, score_mods)`` for tensors on ``device`` (``score_mods``:
    form -> ``(score_mod, score_mod_bwd)``); a one-line error where flash-attn-4 is missing or ``device`` is not
    CUDA. The one place that finds them: the tests put a CPU stand-in here."""
    if not _FOUND:
        try:
            import cutlass
            import cutlass.cute as cute
            from cutlass._mlir.dialects import math as mlir_math
            from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
        except ImportError as error:
            raise ImportError(
                "attn_implementation='flash_attention_4' with ALiBi needs flash-attn-4 (pip install "
                "flash-attn-4==4.0.0b36, or -e '.[fa4]' in hf_alibi's checkout) and a Hopper or Blackwell GPU; "
                "otherwise use model.set_attn_implementation('sdpa')."
            ) from error
        _FOUND["kernels"] = (flash_attn_func, flash_attn_varlen_func, _cute_score_mods(cute, cutlass, mlir_math))
    if device.type != "cuda":
        raise RuntimeError("FlashAttention-4 runs on CUDA only: use model.set_attn_implementation('sdpa') here.")
    return _FOUND["kernels"]


def fa4_refusal(alibi, query: torch.Tensor, key: torch.Tensor, dropout: float, softcap) -> str | None:
    """Why this call cannot run on FA4 with its ALiBi score_mod, one line, else ``None``: the table's features
    (``kernels.py``), then what FA4 lacks beside them."""
    reason = kernel_refusal(NAME, alibi, key.shape[2])
    if reason is not None:
        return reason
    if dropout:
        return "FlashAttention-4 has no attention dropout: set the model's attention dropout to 0, or use 'sdpa'."
    if softcap is not None:
        return "FlashAttention-4 takes a soft-cap or a score_mod, not both: use model.set_attn_implementation('sdpa')."
    if alibi.kind != CAUSAL and query.shape[2] != key.shape[2]:
        return (
            f"FlashAttention-4's symmetric ALiBi needs as many queries as keys (self-attention), got {query.shape[2]} "
            f"and {key.shape[2]}: use model.set_attn_implementation('sdpa')."
        )
    return None


def fa4_alibi_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    forward: AlibiForward | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """ALiBi on FlashAttention-4 (fp16/bf16, CUDA), forward and backward: the layer's slopes as the score_mod's aux
    tensor. ``attention_mask``: transformers' 2D padding mask for flash kernels (or ``None``); padded batches and
    packed rows run as variable-length sequences (``flash.in_flash_layout``). ``sliding_window`` becomes FA4's
    ``window_size``. Shapes ``(B, H, L, D)`` in, ``(B, q, H, D)`` out like transformers' backends."""
    alibi = module.alibi
    alibi.check_heads(query)
    if not module.training:
        dropout = 0.0
    reason = fa4_refusal(alibi, query, key, dropout, softcap)
    if reason is not None:
        raise NotImplementedError(reason)
    flash_attn_func, flash_attn_varlen_func, score_mods = fa4_kernels(query.device)
    score_mod, score_mod_bwd = score_mods[alibi.kind]
    half = query.dtype if query.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    q, k, v = (t.transpose(1, 2).to(half) for t in (query, key, value))  # (B, L, H, D)
    options = dict(
        softmax_scale=scaling, causal=alibi.kind == CAUSAL, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
        aux_tensors=[alibi.fixed_slopes(query.device)],
    )  # fmt: skip
    if sliding_window is not None:
        options["window_size"] = (sliding_window - 1, None if alibi.kind == CAUSAL else sliding_window - 1)

    def dense(q, k, v):
        return flash_attn_func(q, k, v, **options)[0]

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k):
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, **options
        )[0]

    documents = None if forward is None else forward.documents
    output = in_flash_layout(dense, varlen, q, k, v, attention_mask, documents, kwargs)
    alibi.last_path = "fa4"
    return output.to(query.dtype), None
