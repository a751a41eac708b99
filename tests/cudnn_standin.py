"""A CPU stand-in for NVIDIA's cuDNN frontend (PyPI ``nvidia-cudnn-frontend``, the ``cudnn`` module), the part of it
hf_alibi's cuDNN kernel calls, written from the frontend's documented contract (1.32.0: the C++ binding's docstrings of
``pygraph.sdpa`` / ``sdpa_backward``; ``cudnn/_pygraph.py``; ``cudnn/_sdpa_validate.py``; NVIDIA/cudnn-frontend's
``test/python/test_mhas.py``, whose ``compute_ref`` is the semantics below), not from hf_alibi:

- ``pygraph(io_data_type=, intermediate_data_type=, compute_data_type=, handle=)``; ``tensor(dim=, stride=,
  data_type=)``; ``sdpa(q, k, v, generate_stats=, attn_scale=, use_alibi_mask=, diagonal_alignment=,
  diagonal_band_right_bound=, use_padding_mask=, seq_len_q=, seq_len_kv=, dropout=(p, seed, offset))`` -> ``[O,
  Stats]``; ``sdpa_backward(q, k, v, o, dO, stats, ...)`` -> ``[dQ, dK, dV]``; outputs declared with ``set_output``,
  ``set_dim``, ``set_stride``, ``set_data_type`` (each returns the tensor).
- Validation (``_sdpa_validate.py``): ALiBi needs ``diagonal_band_right_bound == 0``; bottom-right alignment refuses
  ALiBi and dropout; padding needs both length tensors, lengths need padding; head sizes multiples of 8; query heads a
  multiple of key heads; dropout below 1; Stats float32; rank-4 tensors, last stride 1. Unsupported graphs raise
  ``cudnnGraphNotSupportedError``.
- A graph runs after ``validate``, ``build_operation_graph``, ``create_execution_plans``, ``check_support``,
  ``build_plans``; ``execute(variant_pack, workspace, handle=)`` reads and writes the bound buffers as declared (the
  stand-in refuses a buffer whose shape, strides or dtype differ from its declaration: cuDNN would read it wrongly),
  with a workspace of at least ``get_workspace_size()`` bytes.
- Semantics (``compute_ref``): ``s = q k^T * attn_scale``, plus ``(col - row) * m_h`` with Press's slopes (the closest
  power of two, then the interleaved rest) when ALiBi is on, keys at or past ``seq_len_kv`` masked, the top-left
  causal band ``col <= row + right_bound``; softmax; dropout multiplies by a mask drawn from (seed, offset) and by
  ``1 / (1 - p)``; Stats is the row's log-sum-exp. k and v heads are shared by consecutive query heads. Output,
  Stats and gradients of padded rows are unspecified: the stand-in writes NaN there.

The backward recomputes the forward (the same dropout mask, from the same seed and offset) in float64 and refuses a
``stats`` or ``o`` that is not the forward's. The mask is a torch generator's Bernoulli draw seeded by (seed, offset),
not cuDNN's Philox stream: what the contract promises is a mask fixed by them, the same in forward and backward.
"""

from __future__ import annotations

import math
from enum import Enum
from types import SimpleNamespace

import torch

data_type = Enum("data_type", "HALF BFLOAT16 FLOAT INT32 INT64")
diagonal_alignment = Enum("diagonal_alignment", "TOP_LEFT BOTTOM_RIGHT")
heur_mode = Enum("heur_mode", "A B FALLBACK")
TORCH_TYPES = {data_type.HALF: torch.float16, data_type.BFLOAT16: torch.bfloat16, data_type.FLOAT: torch.float32,
               data_type.INT32: torch.int32, data_type.INT64: torch.int64}  # fmt: skip
WORKSPACE = 4096

BUILDS: list[dict] = []  # each graph built: its op and options
RUNS: list[dict] = []  # each execution: its op, the dropout mask drawn, the handle's stream
HANDLES: list[dict] = []


class cudnnGraphNotSupportedError(RuntimeError):  # noqa: N801  (the frontend's name)
    pass


def reset():
    BUILDS.clear()
    RUNS.clear()
    HANDLES.clear()


def create_handle():
    handle = {"stream": None}
    HANDLES.append(handle)
    return handle


def set_stream(handle, stream):
    handle["stream"] = stream


def press_slopes(h_q: int) -> torch.Tensor:
    """test_mhas.py's slopes: m_0^(1..n), n the closest power of two, then m_hat_0^(1, 3, 5, ...)."""
    n = 2 ** math.floor(math.log2(h_q))
    m = torch.pow(2.0 ** (-8.0 / n), torch.arange(1, 1 + n, dtype=torch.float64))
    if n < h_q:
        m = torch.cat([m, torch.pow(2.0 ** (-4.0 / n), torch.arange(1, 1 + 2 * (h_q - n), 2, dtype=torch.float64))])
    return m


class Tensor:
    def __init__(self, dim, stride, dtype, virtual=False):
        self.dim, self.stride, self.dtype, self.virtual = list(dim), list(stride), dtype, virtual

    def set_output(self, value):
        self.virtual = not value
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, value):
        self.dtype = value
        return self


class pygraph:  # noqa: N801  (the frontend's name)
    def __init__(self, io_data_type=None, intermediate_data_type=None, compute_data_type=None, handle=None, **kw):
        self.io = io_data_type
        self.node = None
        self.stage = 0

    def tensor(self, dim, stride=None, data_type=None, **kwargs):
        return Tensor(dim, stride, data_type or self.io)

    def sdpa(self, q, k, v, generate_stats=None, **options):
        o = Tensor(q.dim[:-1] + v.dim[-1:], [], self.io, virtual=True)
        stats = Tensor(q.dim[:-1] + [1], [], data_type.FLOAT, virtual=True) if generate_stats else None
        self.node = SimpleNamespace(op="sdpa", inputs=dict(q=q, k=k, v=v), outputs=dict(O=o, Stats=stats), **options)
        return [o, stats]

    def sdpa_backward(self, q, k, v, o, dO, stats, **options):  # noqa: N803  (the frontend's names)
        grads = [Tensor(t.dim, [], self.io, virtual=True) for t in (q, k, v)]
        inputs = dict(q=q, k=k, v=v, o=o, dO=dO, stats=stats)
        self.node = SimpleNamespace(op="sdpa_backward", inputs=inputs, outputs=dict(zip(("dQ", "dK", "dV"), grads)),
                                    **options)  # fmt: skip
        return grads

    def validate(self):
        node = self.node
        get = node.__dict__.get
        declared = [*node.inputs.values(), *(t for t in node.outputs.values() if t is not None)]
        if any(len(t.dim) != 4 or len(t.stride) != 4 for t in declared):
            raise ValueError("The dim / stride of a tensor is invalid")
        if any(t.stride[3] != 1 for t in declared):
            raise cudnnGraphNotSupportedError("The stride for the last dimension should be 1")
        q, k, v = node.inputs["q"], node.inputs["k"], node.inputs["v"]
        if q.dim[1] % k.dim[1] or q.dim[1] % v.dim[1]:
            raise cudnnGraphNotSupportedError("For group-query attention, number of heads for key and query ...")
        if q.dim[3] % 8 or v.dim[3] % 8:
            raise cudnnGraphNotSupportedError("hidden_dim should be multiple of 8")
        right = get("diagonal_band_right_bound")
        if get("use_alibi_mask") and right != 0:
            raise cudnnGraphNotSupportedError("When alibi mask is used, diagonal_band_right_bound needs to be 0.")
        bottom_right = get("diagonal_alignment") == diagonal_alignment.BOTTOM_RIGHT and right is not None
        if bottom_right and (get("use_alibi_mask") or get("dropout")):
            raise cudnnGraphNotSupportedError("Bottom right causal mask is only supported with is_alibi=False ...")
        lengths = get("seq_len_q") is not None, get("seq_len_kv") is not None
        if get("use_padding_mask") and not all(lengths):
            raise ValueError("Padding mask requires seq_len_q/seq_len_kv to be set.")
        if any(lengths) and not get("use_padding_mask"):
            raise ValueError("seq_len_q/seq_len_kv needs to be set only if padding mask is enabled.")
        if get("dropout") is not None and not 0 <= get("dropout")[0] < 1:
            raise ValueError("Dropout probability cannot be 1 as corresponding scale wont be well formed.")
        stats = node.outputs.get("Stats") if node.op == "sdpa" else node.inputs["stats"]
        if stats is not None and stats.dtype != data_type.FLOAT:
            raise cudnnGraphNotSupportedError("The Stats output of sdpa must be an FP32 tensor.")
        self.stage = 1

    def build_operation_graph(self):
        assert self.stage == 1, "validate() first"
        self.stage = 2

    def create_execution_plans(self, heuristics):
        assert self.stage == 2 and heuristics, "build_operation_graph() first, with heuristics modes"
        self.stage = 3

    def check_support(self):
        assert self.stage == 3
        self.stage = 4

    def build_plans(self):
        assert self.stage == 4
        self.stage = 5
        node = self.node
        options = {k: v for k, v in node.__dict__.items() if k not in ("inputs", "outputs")}
        BUILDS.append(dict(options, io=self.io))

    def get_workspace_size(self):
        assert self.stage == 5, "build() first"
        return WORKSPACE

    def execute(self, variant_pack, workspace, handle=None):
        assert self.stage == 5 and handle is not None, "a built graph, run on a handle"
        assert workspace.dtype == torch.uint8 and workspace.numel() >= WORKSPACE
        node = self.node
        get = node.__dict__.get
        declared = {**node.inputs, **{n: t for n, t in node.outputs.items() if t is not None}}
        for name in ("seq_len_q", "seq_len_kv"):
            if get(name) is not None:
                declared[name] = get(name)
        if get("dropout") is not None:
            declared["seed"], declared["offset"] = get("dropout")[1], get("dropout")[2]
        data = {}
        for name, tensor in declared.items():
            bound = [buffer for t, buffer in variant_pack.items() if t is tensor]
            if not bound:
                raise ValueError(f"tensor {name} is not bound in the variant pack")
            buffer = bound[0]
            if list(buffer.shape) != tensor.dim:
                raise ValueError(f"{name}: bound {list(buffer.shape)}, declared {tensor.dim}")
            if name not in ("seq_len_q", "seq_len_kv", "seed", "offset") and list(buffer.stride()) != tensor.stride:
                raise ValueError(f"{name}: bound strides {list(buffer.stride())}, declared {tensor.stride}")
            if buffer.dtype != TORCH_TYPES[tensor.dtype]:
                raise ValueError(f"{name}: bound {buffer.dtype}, declared {tensor.dtype}")
            data[name] = buffer
        run = dict(op=node.op, stream=handle["stream"])
        RUNS.append(run)
        if node.op == "sdpa":
            self._forward(data, run)
        else:
            self._backward(data, run)

    def _attention(self, q, k, v, data, run):
        """compute_ref in float64: O, Stats, the real query rows (B, Sq), the softmax P, the dropout factor (the mask
        over 1 - p, or 1) and the k, v each query head reads."""
        get = self.node.__dict__.get
        b, h_q, s_q, _ = q.shape
        s_kv = k.shape[2]
        k = k.repeat_interleave(h_q // k.shape[1], dim=1)
        v = v.repeat_interleave(h_q // v.shape[1], dim=1)
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) * get("attn_scale", 1.0)
        row = torch.arange(s_q, dtype=torch.float64)[:, None]
        col = torch.arange(s_kv, dtype=torch.float64)[None, :]
        if get("use_alibi_mask"):
            s = s + (col - row) * press_slopes(h_q).view(1, -1, 1, 1)
        real_q = torch.ones(b, s_q, dtype=torch.bool)
        if get("use_padding_mask"):
            len_q, len_kv = data["seq_len_q"].flatten().tolist(), data["seq_len_kv"].flatten().tolist()
            for i in range(b):
                s[i, :, :, len_kv[i] :] = -math.inf
                real_q[i, len_q[i] :] = False
        if get("diagonal_band_right_bound") is not None:
            s = s.masked_fill(col > row + get("diagonal_band_right_bound"), -math.inf)
        stats = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        factor = torch.ones_like(p)
        if get("dropout") is not None:
            probability = get("dropout")[0]
            seed, offset = int(data["seed"].flatten()[0]), int(data["offset"].flatten()[0])
            generator = torch.Generator().manual_seed((seed * 1_000_003 + offset) % 2**63)
            mask = torch.rand(p.shape, generator=generator, dtype=torch.float64) >= probability
            run["mask"] = mask
            factor = mask / (1 - probability)
        return torch.einsum("bhqk,bhkd->bhqd", p * factor, v), stats, real_q, p, factor, k, v

    def _forward(self, data, run):
        q, k, v = (data[n].double() for n in "qkv")
        out, stats, real_q, *_ = self._attention(q, k, v, data, run)
        padded = ~real_q[:, None, :, None]
        data["O"].copy_(out.masked_fill(padded, math.nan))
        if "Stats" in data:
            data["Stats"].copy_(stats.masked_fill(padded, math.nan))

    def _backward(self, data, run):
        """The attention's gradients written out (dV = (P*F)^T dO, dP = dO V^T * F, dS = P (dP - rowsum(dP P)),
        dQ = dS K * scale, dK = dS^T Q * scale; F the dropout factor), each summed over the query heads that share a
        key head."""
        q, k, v = (data[n].double() for n in "qkv")
        out, stats, real_q, p, factor, k_all, v_all = self._attention(q, k, v, data, run)
        rows = real_q[:, None, :, None]
        if not torch.allclose(data["stats"].double()[rows.expand_as(stats)], stats[rows.expand_as(stats)], rtol=1e-5):
            raise ValueError("sdpa_backward: stats is not the forward's softmax statistics")
        if (data["o"].double() - out)[rows.expand_as(out)].abs().max() > 2e-2 * out.abs().max():
            raise ValueError("sdpa_backward: o is not the forward's output")
        d_out = data["dO"].double().masked_fill(~rows, 0.0)
        scale = self.node.__dict__.get("attn_scale", 1.0)
        d_v = torch.einsum("bhqk,bhqd->bhkd", p * factor, d_out)
        d_p = torch.einsum("bhqd,bhkd->bhqk", d_out, v_all) * factor
        d_s = p * (d_p - (d_p * p).sum(-1, keepdim=True))
        d_q = torch.einsum("bhqk,bhkd->bhqd", d_s, k_all) * scale
        d_k = torch.einsum("bhqk,bhqd->bhkd", d_s, q) * scale

        def per_key_head(grad, heads):
            return grad.view(grad.shape[0], heads, -1, *grad.shape[2:]).sum(2)

        grads = (d_q, per_key_head(d_k, k.shape[1]), per_key_head(d_v, v.shape[1]))
        for name, grad in zip(("dQ", "dK", "dV"), grads):
            padded = ~rows if name == "dQ" else self._padded_keys(data, grad)
            data[name].copy_(grad.masked_fill(padded, math.nan))

    def _padded_keys(self, data, grad):
        if not self.node.__dict__.get("use_padding_mask"):
            return torch.zeros(1, 1, 1, 1, dtype=torch.bool)
        real = torch.arange(grad.shape[2])[None, :] < data["seq_len_kv"].flatten()[:, None]
        return ~real[:, None, :, None]
