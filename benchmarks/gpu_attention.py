"""One attention call, forward + backward, apart from the model: where each hf_alibi kernel's cost on a GPU comes from.

    python benchmarks/gpu_attention.py                              # bf16, 12 heads of 64, L = 1k / 4k / 16k, batch 1
    python benchmarks/gpu_attention.py --batch 8 --lengths 1024 4096
    python benchmarks/gpu_attention.py --device cpu --lengths 256   # the arms that run on the CPU (a dry run)
    python benchmarks/gpu_attention.py --batch 8 --lengths 1024 4096 --dropout 0.1   # attention dropout in every arm

benchmarks/gpu.py times whole training steps, where the attention kernel is one cost among the layers' matrix
products, the fold's concatenations and the launches of a batch of 1. This script times the kernels themselves on
causal self-attention of shape ``(batch, heads, L, 64)``, each arm's median of ``--repeats`` interleaved calls (CUDA
events), as a ratio of the fastest unpatched kernel at that length. Arms:

- ``plain-cudnn``, ``plain-flash``, ``plain-efficient``: ``F.scaled_dot_product_attention(is_causal=True)`` held to
  one SDPA kernel (no ALiBi): the baseline is the fastest of them;
- ``plain-cudnn-72``: the same on cuDNN with q and k padded to a head of 72 (values 64), no ALiBi: the kernel the
  cuDNN fold runs, without the fold's channel building and concatenations, so ``fold-cudnn`` less this is their cost;
- ``bias-kernel``: SDPA with the layer's bias tensor (``AlibiBias``, causal masking in it, bf16) built beforehand and
  kernel left to SDPA: what every layer but a forward's first runs on the bias path;
- ``bias``: hf_alibi's ``alibi_sdpa`` on the bias path (``path="bias"``), building the bias tensor in the call, as a
  forward's first layer does;
- ``fold-cudnn``, ``fold-channel``: ``alibi_sdpa`` on the folded path in its cuDNN construction and its channel one
  (the latter run by SDPA's flash kernel at a head of 72, hence 96 wide);
- ``fa4-plain``, ``fa4``: FlashAttention-4 causal with no ``score_mod`` and hf_alibi's ``alibi_flash_attention_4``
  (the slope read from an aux tensor for every score), when flash-attn-4 is installed (Hopper or Blackwell);
- ``cudnn``: hf_alibi's ``alibi_cudnn`` (cuDNN's own fused ALiBi through nvidia-cudnn-frontend, ``.[cuda]``), when the
  frontend is installed.

``--dropout P`` gives every arm attention dropout P (the unpatched ones ``dropout_p``, the ALiBi ones a training
layer's ``dropout``); an arm that has none (FlashAttention-4) prints its refusal.

An arm that cannot run prints why in place of its figures. ``--device cpu`` runs the arms that need no CUDA kernel
(a check of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's hf_alibi

from hf_alibi.core.bias import AlibiBias  # noqa: E402
from hf_alibi.core.folded import FOLD_ENV  # noqa: E402

PLAIN = {"plain-cudnn": SDPBackend.CUDNN_ATTENTION, "plain-flash": SDPBackend.FLASH_ATTENTION}
PLAIN["plain-efficient"] = SDPBackend.EFFICIENT_ATTENTION
ARMS = (*PLAIN, "plain-cudnn-72", "bias-kernel", "bias", "fold-cudnn", "fold-channel", "fa4-plain", "fa4", "cudnn")
CUDA_ONLY = ("plain-cudnn", "plain-efficient", "plain-cudnn-72", "fold-cudnn", "fa4-plain", "fa4", "cudnn")


class Layer(nn.Module):
    """What transformers' attention functions read of a layer: its ALiBi bias, causality, training."""

    def __init__(self, heads: int, path: str):
        super().__init__()
        self.alibi = AlibiBias("causal", heads, path=path)
        self.is_causal = True


def _kernel_arm(backend: str, heads: int, device: torch.device, dropout: float) -> Callable:
    """hf_alibi's ALiBi function for ``backend`` (its ``alibi_<backend>`` registration) on a layer of the "auto"
    path, as transformers calls it: (q, k, v) -> output; ``.layer`` is the layer (called from :func:`make_arm`, which
    imports hf_alibi: the registrations)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    layer = Layer(heads, "auto").to(device).train()
    run = ALL_ATTENTION_FUNCTIONS[f"alibi_{backend}"]

    def kernel(q, k, v):
        return run(layer, q, k, v, None, scaling=q.shape[-1] ** -0.5, dropout=dropout)[0]

    kernel.layer = layer
    return kernel


def make_arm(arm: str, heads: int, length: int, device: torch.device, dropout: float = 0.0) -> Callable | str:
    """A function of (q, k, v) -> output for this arm (with attention dropout ``dropout``), or why it cannot run."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import hf_alibi  # noqa: F401  (registers alibi_sdpa and alibi_flash_attention_4)

    if arm in CUDA_ONLY and device.type != "cuda":
        return "needs CUDA"
    if arm in PLAIN:
        kernel = PLAIN[arm]

        def plain(q, k, v):
            with sdpa_kernel([kernel]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)

        return plain
    if arm == "plain-cudnn-72":

        def wide(q, k, v):
            pad = q.new_zeros(*q.shape[:-1], 8)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(
                    torch.cat([q, pad], -1),
                    torch.cat([k, pad], -1),
                    v,
                    is_causal=True,
                    scale=q.shape[-1] ** -0.5,
                    dropout_p=dropout,
                )

        return wide
    if arm == "bias-kernel":
        mask = Layer(heads, "bias").alibi(length, length, device, torch.finfo(torch.bfloat16).min)
        mask = mask.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
    if arm in ("fa4-plain", "fa4"):
        from hf_alibi.core.fa4 import fa4_kernels  # the one place that finds FlashAttention-4

        try:
            flash_attn_func = fa4_kernels(device)[0]
        except ImportError:
            return "flash-attn-4 not installed"
        if torch.cuda.get_device_capability(device)[0] < 9:
            return "FA4 needs Hopper or Blackwell"
        if arm == "fa4-plain":
            return lambda q, k, v: flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)[0]
        return _kernel_arm("flash_attention_4", heads, device, dropout)
    if arm == "cudnn":
        from hf_alibi.core.cudnn import cudnn_frontend  # the one place that finds the cuDNN frontend

        try:
            cudnn_frontend(device)
        except ImportError:
            return "nvidia-cudnn-frontend not installed (.[cuda])"
        return _kernel_arm("cudnn", heads, device, dropout)
    path = "bias" if arm == "bias" else "folded"
    layer = Layer(heads, path).to(device).train()
    run = ALL_ATTENTION_FUNCTIONS["alibi_sdpa"]
    construction = {"fold-cudnn": "cudnn", "fold-channel": "channel"}.get(arm)

    def alibi(q, k, v):
        saved = os.environ.get(FOLD_ENV)
        if construction is not None:
            os.environ[FOLD_ENV] = construction
        try:
            return run(layer, q, k, v, None, scaling=q.shape[-1] ** -0.5, dropout=dropout)[0]
        finally:  # the user's own setting back, for the next arm
            if saved is None:
                os.environ.pop(FOLD_ENV, None)
            else:
                os.environ[FOLD_ENV] = saved

    alibi.layer = layer  # its alibi.last_path says which path ran
    return alibi


def timed(fn: Callable, q, k, v, grad: torch.Tensor) -> float:
    """Milliseconds of one forward + backward (CUDA events on a GPU, the wall clock elsewhere)."""
    for t in (q, k, v):
        t.grad = None

    def step():
        out = fn(q, k, v)
        out.backward(grad.reshape(out.shape))

    if q.device.type != "cuda":
        begin = time.perf_counter()
        step()
        return (time.perf_counter() - begin) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def run_length(length: int, args, device: torch.device, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(length)
    q, k, v = (
        torch.randn(args.batch, args.heads, length, args.head_dim, generator=g).to(device, dtype).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn(args.batch * args.heads * length * args.head_dim, generator=g).to(device, dtype)
    arms: dict[str, Callable | str] = {}
    for arm in args.arms:
        try:
            arms[arm] = make_arm(arm, args.heads, length, device, args.dropout)
        except Exception as error:  # noqa: BLE001  (one arm's failure must not end the table)
            arms[arm] = f"{type(error).__name__}: {str(error).splitlines()[0][:70]}"
    times: dict[str, list | str] = {arm: [] if callable(fn) else fn for arm, fn in arms.items()}
    for round_ in range(args.warmup + args.repeats):
        for arm, fn in arms.items():
            if isinstance(times[arm], str):
                continue
            try:
                ms = timed(fn, q, k, v, grad)
            except torch.cuda.OutOfMemoryError:
                times[arm] = "OOM"
                torch.cuda.empty_cache()
                continue
            except Exception as error:  # noqa: BLE001
                times[arm] = f"{type(error).__name__}: {str(error).splitlines()[0][:70]}"
                continue
            if round_ >= args.warmup:
                times[arm].append(ms)
    medians = {arm: statistics.median(t) if isinstance(t, list) else t for arm, t in times.items()}
    plain = {arm: ms for arm, ms in medians.items() if arm in PLAIN and not isinstance(ms, str)}
    best = min(plain, key=plain.get) if plain else None
    print(f"\nL={length} batch={args.batch} heads={args.heads} head_dim={args.head_dim} {dtype}, "
          f"dropout {args.dropout}, forward+backward, median of {args.repeats}; "
          f"baseline: {best or 'none ran'}")  # fmt: skip
    print(f"{'arm':<16}{'ms':>10}{'ratio':>8}  path")
    for arm, ms in medians.items():
        if isinstance(ms, str):
            print(f"{arm:<16}  {ms}")
            continue
        ratio = f"{ms / plain[best]:.2f}" if best else "-"
        layer = getattr(arms[arm], "layer", None)
        print(f"{arm:<16}{ms:>10.3f}{ratio:>8}  {layer.alibi.last_path if layer is not None else '-'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="*", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.0, help="attention dropout in every arm")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        print(torch.cuda.get_device_name(device), "torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())
    for length in args.lengths:
        run_length(length, args, device, dtype)


if __name__ == "__main__":
    main()
