"""cuDNN's fused ALiBi (NVIDIA's ``nvidia-cudnn-frontend``): attn_implementation ``"cudnn"``, forward and backward.

cuDNN's SDPA graph has ALiBi as an option of its own: the kernel adds ``(j - i) * m_h`` to each scaled score, with the
paper's slopes (the closest power of two, then the interleaved rest) written by the frontend itself. So it renders
one form only: causal self-attention (queries and keys the same tokens, ``Sq == Sk``) with the paper's slopes. Sinks,
fitted or per-layer slopes, a bias rounded per key (Falcon), the encoder forms, a KV cache or a chunk (its causal mask
with ALiBi is aligned top-left only), packed rows, left padding, sliding windows, a soft-cap, fp32 and head sizes that
are not a multiple of 8 are refused in one line that names the route to use. Right padding runs as cuDNN's padding
mask (``seq_len_q`` / ``seq_len_kv``); attention dropout runs inside cuDNN's graph (its Philox mask, drawn from a
seed and an offset that torch's generator draws, so ``torch.manual_seed`` reproduces it), never skipped.

The contract, read in nvidia-cudnn-frontend 1.32.0 (the PyPI wheel; the C++ binding's docstrings in
``cudnn/_compiled_module``, the Python in ``cudnn/_pygraph.py``, ``cudnn/_sdpa_validate.py``, ``cudnn/__init__.py``;
NVIDIA/cudnn-frontend's ``test/python/test_mhas.py`` for the reference it tests against):

- ``cudnn.pygraph(io_data_type=, intermediate_data_type=, compute_data_type=, handle=)``; ``graph.tensor(dim=,
  stride=, data_type=)`` declares q, k, v ``(B, H, S, D)`` with any strides whose last is 1 (k and v may have fewer
  heads, dividing the query's); ``graph.sdpa(q, k, v, generate_stats=True, attn_scale=, use_alibi_mask=True,
  diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0, use_padding_mask=, seq_len_q=,
  seq_len_kv=, dropout=(probability, seed, offset))`` returns ``[O, Stats]`` (Stats ``(B, H, Sq, 1)`` float32, the
  row's log-sum-exp, which the backward reads); ``graph.sdpa_backward(q, k, v, o, dO, stats, ...the same options)``
  returns ``[dQ, dK, dV]``. Seed and offset are int64 ``(1, 1, 1, 1)`` tensors; the sequence lengths int32
  ``(B, 1, 1, 1)``.
- ``_sdpa_validate.py``: ``use_alibi_mask`` needs ``diagonal_band_right_bound == 0``; the bottom-right alignment
  refuses ALiBi and dropout; padding needs both length tensors; head sizes multiples of 8; dropout below 1. A graph
  cuDNN cannot run raises ``cudnn.cudnnGraphNotSupportedError`` (at ``validate`` or ``check_support``).
- A graph is built once (``validate``, ``build_operation_graph``, ``create_execution_plans([heur_mode.A,
  heur_mode.FALLBACK])``, ``check_support``, ``build_plans``) and run by ``execute(variant_pack, workspace,
  handle=)``, the workspace ``get_workspace_size()`` bytes, on the stream ``cudnn.set_stream(handle, stream)`` set.
- ``test_mhas.py``'s reference: ``s = q k^T * attn_scale + (col - row) * m_h``, keys at or past ``seq_len_kv``
  masked, then the top-left causal mask; dropout multiplies the softmax by the Philox mask and by ``1 / (1 - p)``.
  Output, stats and gradients of padded rows are left unspecified (it zeroes them on both sides before comparing):
  hf_alibi zeroes them.

Graphs are cached per direction, shapes, strides, dtype, device, scale, dropout and padding (:data:`_GRAPHS`); a cuDNN
handle is made per thread and device and runs on the current CUDA stream. The forward and the backward are torch
custom ops with fake implementations, so ``torch.compile(fullgraph=True)`` traces them. The frontend is found in one
place (:func:`cudnn_frontend`), where the tests put a CPU stand-in written from this contract
(``tests/cudnn_standin.py``).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from .forward import AlibiForward
from .kernels import KERNEL_BY_NAME, kernel_refusal

NAME = "cudnn"
HALF = (torch.float16, torch.bfloat16)
SDPA = "use model.set_attn_implementation('sdpa')"
# the custom ops' namespace: this copy's (the library's core, or a checkpoint's remote code), so copies never clash
_NAMESPACE = "".join(c if c.isalnum() else "_" for c in __name__.rpartition(".")[0]) or "hf_alibi_core"
_FOUND: dict = {}
MAX_GRAPHS = 128  # built graphs kept (each shape, stride and dtype of a run's layers builds two: forward, backward)
_GRAPHS: dict = {}
_LOCAL = threading.local()  # cuDNN handles are not shared between threads


def cudnn_frontend(device: torch.device):
    """The frontend's ``cudnn`` module for tensors on ``device``; a one-line error where ``nvidia-cudnn-frontend`` is
    missing (what to install, and which kernel runs instead) or ``device`` is not CUDA. The one place that finds it:
    the tests put a CPU stand-in here."""
    if "module" not in _FOUND:
        try:
            import cudnn
        except ImportError as error:
            raise ImportError(
                f"attn_implementation='cudnn' (cuDNN's fused ALiBi) needs NVIDIA's cuDNN frontend: "
                f"{KERNEL_BY_NAME[NAME].install}; without it, {SDPA}, which runs the fold or the bias path instead."
            ) from error
        _FOUND["module"] = cudnn
    if device.type != "cuda":
        raise RuntimeError(f"cuDNN's fused ALiBi runs on CUDA only: {SDPA} here.")
    return _FOUND["module"]


def cudnn_refusal(alibi, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: dict) -> str | None:
    """Why this call cannot run on cuDNN's fused ALiBi, one line, else ``None``: the table's features (``kernels.py``:
    the causal form, the paper's slopes, no sinks, no rounding), then what the call asks beside them (``call``: the
    attention function's ``softcap``, ``sliding_window``, ``forward`` and keyword arguments)."""
    reason = kernel_refusal(NAME, alibi, key.shape[2])
    if reason is not None:
        return reason
    forward = call.get("forward")
    if (forward is not None and forward.documents is not None) or call.get("cu_seq_lens_q") is not None:
        return f"cuDNN's fused ALiBi does not run packed rows (one document each) here: {SDPA} for this model."
    if call.get("softcap") is not None:
        return f"cuDNN's fused ALiBi takes no soft-cap: {SDPA}."
    if call.get("sliding_window") is not None:
        return f"cuDNN's fused ALiBi takes no sliding window here: {SDPA} for this model."
    if query.dtype not in HALF:
        return f"cuDNN's fused attention takes bf16 or fp16, got {query.dtype}: load the model in either, or {SDPA}."
    if query.shape[2] != key.shape[2]:
        return (
            f"cuDNN's fused ALiBi aligns its causal mask top-left, so it needs as many queries as keys (training, "
            f"prefill), got {query.shape[2]} and {key.shape[2]} (a KV cache): {SDPA} to generate."
        )
    if query.shape[-1] % 8 or value.shape[-1] % 8:
        return f"cuDNN's fused attention needs head sizes that are multiples of 8, got {query.shape[-1]}: {SDPA}."
    return None


def cudnn_alibi_attention(
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
    """Causal ALiBi with the paper's slopes on cuDNN's fused SDPA (bf16/fp16, CUDA), forward and backward, attention
    dropout applied by cuDNN's graph. ``attention_mask``: transformers' 2D padding mask for flash-style kernels (or
    ``None``); right-padded rows run as cuDNN's padding mask, left padding is refused. Shapes ``(B, H, L, D)`` in
    (k, v may have fewer heads), ``(B, q, H, D)`` out like transformers' backends."""
    alibi = module.alibi
    alibi.check_heads(query)
    if not module.training:
        dropout = 0.0
    call = dict(kwargs, forward=forward, softcap=softcap, sliding_window=sliding_window)
    reason = cudnn_refusal(alibi, query, key, value, call)
    if reason is not None:
        raise NotImplementedError(reason)
    cudnn_frontend(query.device)  # a missing package or a CPU tensor: refused here, before any work
    scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    # dropout's seed and offset, drawn by torch's generator on the device: torch.manual_seed reproduces the mask
    rng = torch.randint(0, 2**62, (2,), device=q.device, dtype=torch.int64) if dropout else None
    padding = None if attention_mask is None else attention_mask.to(device=q.device, dtype=torch.int32)
    output, _ = cudnn_alibi_forward(q, k, v, padding, rng, scale, float(dropout))
    alibi.last_path = "cudnn"
    return output, None


def _lengths(padding: torch.Tensor | None, check: bool) -> torch.Tensor | None:
    # each row's real tokens, int32 (B,): cuDNN's padding counts them from the row's start (right padding only)
    if padding is None:
        return None
    if check and bool((padding[:, 1:] > padding[:, :-1]).any()):
        raise NotImplementedError(
            "cuDNN's padding keeps each row's real tokens first: this batch is left-padded (or has holes): pad on "
            f"the right (tokenizer.padding_side = 'right') or {SDPA}."
        )
    return padding.sum(-1, dtype=torch.int32)


def _zero_padded(tensor: torch.Tensor, lengths: torch.Tensor | None, seq_dim: int) -> torch.Tensor:
    # cuDNN leaves padded rows unspecified: zeros there, as transformers' flash kernels give
    if lengths is None:
        return tensor
    real = torch.arange(tensor.shape[seq_dim], device=tensor.device)[None, :] < lengths[:, None]  # (B, S)
    shape = [tensor.shape[0]] + [1] * (tensor.dim() - 1)
    shape[seq_dim] = tensor.shape[seq_dim]
    return tensor.masked_fill_(~real.view(shape), 0)


def _handle(cudnn, device: torch.device):
    # one handle per thread and device, on the current stream (the frontend skips the call when it is unchanged)
    handles = _LOCAL.__dict__.setdefault("handles", {})
    handle = handles.get(device)
    on_cuda = device.type == "cuda"
    if handle is None:
        with torch.cuda.device(device) if on_cuda else contextlib.nullcontext():
            handle = handles[device] = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream if on_cuda else 0)
    return handle


def _graph(cudnn, handle, direction: str, named: dict, scale: float, dropout: float, padded: bool):
    """The built graph for these tensors (``named``: port -> tensor, each declared with its shape and strides) and
    options, with its declared tensors and workspace size, made once (:data:`_GRAPHS`)."""
    first = next(iter(named.values()))
    key = (direction, first.device, first.dtype, scale, dropout, padded)
    key += tuple((port, tuple(t.shape), t.stride()) for port, t in named.items())
    entry = _GRAPHS.get(key)
    if entry is not None:
        return entry
    types = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}
    graph = cudnn.pygraph(io_data_type=types[first.dtype], intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)  # fmt: skip
    inputs = ("q", "k", "v") if direction == "forward" else ("q", "k", "v", "o", "dO", "stats")
    declared = {
        port: graph.tensor(dim=list(named[port].shape), stride=list(named[port].stride()), data_type=types.get(
            named[port].dtype, cudnn.data_type.FLOAT)) for port in inputs
    }  # fmt: skip
    options = dict(attn_scale=scale, use_alibi_mask=True, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                   diagonal_band_right_bound=0)  # fmt: skip
    if padded:
        for side in ("seq_len_q", "seq_len_kv"):
            declared[side] = graph.tensor(dim=[first.shape[0], 1, 1, 1], stride=[1, 1, 1, 1],
                                          data_type=cudnn.data_type.INT32)  # fmt: skip
            options[side] = declared[side]
        options["use_padding_mask"] = True
    if dropout:
        for part in ("seed", "offset"):
            declared[part] = graph.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64)
        options["dropout"] = (dropout, declared["seed"], declared["offset"])
    if direction == "forward":
        outputs = dict(zip(("o", "stats"), graph.sdpa(*(declared[p] for p in inputs), generate_stats=True, **options)))
    else:
        outputs = dict(zip(("dq", "dk", "dv"), graph.sdpa_backward(*(declared[p] for p in inputs), **options)))
    for port, tensor in outputs.items():
        tensor.set_output(True).set_dim(list(named[port].shape)).set_stride(list(named[port].stride()))
        tensor.set_data_type(types.get(named[port].dtype, cudnn.data_type.FLOAT))
    declared.update(outputs)
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except cudnn.cudnnGraphNotSupportedError as error:
        said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise NotImplementedError(f"cuDNN cannot run this attention call ({said}): {SDPA} for this model.") from None
    if len(_GRAPHS) >= MAX_GRAPHS:
        del _GRAPHS[next(iter(_GRAPHS))]  # the oldest
    entry = _GRAPHS[key] = (graph, declared, graph.get_workspace_size())
    return entry


def _execute(direction: str, named: dict, lengths, rng, scale: float, dropout: float) -> None:
    # runs one graph on the tensors in ``named`` (outputs written in place)
    device = next(iter(named.values())).device
    cudnn = cudnn_frontend(device)
    handle = _handle(cudnn, device)
    if lengths is not None:
        named["seq_len_q"] = named["seq_len_kv"] = lengths.view(-1, 1, 1, 1)
    if rng is not None:
        named["seed"], named["offset"] = rng[0:1].view(1, 1, 1, 1), rng[1:2].view(1, 1, 1, 1)
    shaped = {port: t for port, t in named.items() if port not in ("seq_len_q", "seq_len_kv", "seed", "offset")}
    graph, declared, workspace_size = _graph(cudnn, handle, direction, shaped, scale, dropout, lengths is not None)
    workspace = torch.empty(workspace_size, device=device, dtype=torch.uint8)
    graph.execute({declared[port]: t for port, t in named.items()}, workspace, handle=handle)


def _forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padding: torch.Tensor | None,
    rng: torch.Tensor | None,
    scale: float,
    dropout: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, length, _ = q.shape
    lengths = _lengths(padding, check=True)
    output = torch.empty(batch, length, heads, v.shape[-1], device=q.device, dtype=q.dtype)  # (B, q, H, Dv)
    stats = torch.empty(batch, heads, length, 1, device=q.device, dtype=torch.float32)
    named = dict(q=q, k=k, v=v, o=output.transpose(1, 2), stats=stats)
    _execute("forward", named, lengths, rng, scale, dropout)
    return _zero_padded(output, lengths, 1), stats


def _backward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    output: torch.Tensor,
    grad: torch.Tensor,
    stats: torch.Tensor,
    padding: torch.Tensor | None,
    rng: torch.Tensor | None,
    scale: float,
    dropout: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lengths = _lengths(padding, check=False)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    named = dict(q=q, k=k, v=v, o=output.transpose(1, 2), dO=grad.contiguous().transpose(1, 2), stats=stats)
    named.update(dq=dq, dk=dk, dv=dv)
    _execute("backward", named, lengths, rng, scale, dropout)
    return tuple(_zero_padded(t, lengths, 2) for t in (dq, dk, dv))


def _forward_fake(q, k, v, padding, rng, scale, dropout):
    batch, heads, length, _ = q.shape
    return q.new_empty(batch, length, heads, v.shape[-1]), q.new_empty(batch, heads, length, 1, dtype=torch.float32)


def _backward_fake(q, k, v, output, grad, stats, padding, rng, scale, dropout):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# the forward, (q, k, v, padding, rng, scale, dropout) -> (output (B, q, H, Dv), stats (B, H, q, 1)), and its backward,
# (q, k, v, output, grad, stats, padding, rng, scale, dropout) -> (dq, dk, dv): torch custom ops, opaque to
# torch.compile, which traces them through their fake implementations
cudnn_alibi_forward = torch.library.custom_op(f"{_NAMESPACE}::cudnn_alibi_forward", mutates_args=())(_forward_impl)
cudnn_alibi_backward = torch.library.custom_op(f"{_NAMESPACE}::cudnn_alibi_backward", mutates_args=())(_backward_impl)
cudnn_alibi_forward.register_fake(_forward_fake)
cudnn_alibi_backward.register_fake(_backward_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, padding, rng, scale, dropout = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], padding, rng)
    ctx.scale, ctx.dropout = scale, dropout


def _backward(ctx, grad_output, grad_stats):
    q, k, v, output, stats, padding, rng = ctx.saved_tensors
    dq, dk, dv = cudnn_alibi_backward(q, k, v, output, grad_output, stats, padding, rng, ctx.scale, ctx.dropout)
    return dq, dk, dv, None, None, None, None


cudnn_alibi_forward.register_autograd(_backward, setup_context=_setup_context)
