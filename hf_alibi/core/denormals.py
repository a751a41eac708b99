"""Flush-to-zero inside hf_alibi's attention kernels on the CPU, and nowhere else.

ALiBi's far keys get large negative scores, so ``exp(s - max)`` in the attention kernels lands in float32's
subnormal range (``s - max`` between -104 and -87); many x86 processors compute subnormals in microcode, and
the kernels then run up to 2x slower (measured on an Intel Xeon; this project's AMD EPYC pays nothing). Such a
weight is below ``2^-126`` of the row's largest: flushing it to zero changes no float32 result beyond rounding.

Flush-to-zero and denormals-are-zero are bits of each thread's MXCSR. ``torch.set_flush_denormal`` sets the
calling thread's only, while torch's kernels run on its OpenMP team too. So the state is set on every thread of
the calling thread's team (libgomp's ``GOMP_parallel`` runs libm's ``fesetenv`` on each, no Python involved:
about 5 us to set and restore) around each kernel call, forward (:func:`flushed`) and backward (:func:`bracket`:
identity autograd functions on the kernel's inputs and outputs, whose backward passes set and restore it around
the kernel's backward), and restored to the caller's state afterwards: the user's program outside the kernels
keeps its floating-point state. Nothing happens while torch.compile / torch.export traces, on other devices, where
the caller already flushes, or where this is not x86-64 Linux with torch's GNU OpenMP (then :func:`available` is
False and the kernels run as they always did).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import struct
import threading
from contextlib import contextmanager

import torch

from .compat import is_exporting, torch_openmp_library

FLUSH_BITS = 0x8040  # MXCSR: flush-to-zero (bit 15) and denormals-are-zero (bit 6)
_ENV_SIZE, _MXCSR_OFFSET = 32, 28  # glibc's x86-64 fenv_t: the x87 environment, then the MXCSR
# HF_ALIBI_FLUSH_DENORMALS=0 turns it off (benchmarks measure both)
ENV_SWITCH = "HF_ALIBI_FLUSH_DENORMALS"


class _Team:
    """libgomp's GOMP_parallel and libm's fegetenv / fesetenv, found once."""

    def __init__(self):
        self.ready = False
        if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
            return
        libm_name, gomp_path = ctypes.util.find_library("m"), torch_openmp_library()
        if libm_name is None or gomp_path is None:
            return
        try:
            libm, gomp = ctypes.CDLL(libm_name), ctypes.CDLL(gomp_path)
            self.fegetenv = libm.fegetenv
            self.fesetenv = ctypes.cast(libm.fesetenv, ctypes.c_void_p)
            self.parallel = gomp.GOMP_parallel
        except (OSError, AttributeError):
            return
        self.parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        self.parallel.restype = None
        env = self.read()
        # an MXCSR has its six exception masks set unless a program unmasked them: else the layout is not glibc's
        self.ready = env is not None and (self.mxcsr(env) & 0x1F80) == 0x1F80

    def read(self) -> ctypes.Array | None:
        env = ctypes.create_string_buffer(_ENV_SIZE)
        return env if self.fegetenv(env) == 0 else None

    @staticmethod
    def mxcsr(env) -> int:
        return struct.unpack_from("<I", env.raw, _MXCSR_OFFSET)[0]

    def write_all(self, env) -> None:
        """The calling thread and every thread of its OpenMP team (torch's intra-op threads) take ``env``."""
        self.parallel(self.fesetenv, env, torch.get_num_threads(), 0)


_TEAM: _Team | None = None
_LOCK = threading.Lock()


def _team() -> _Team:
    global _TEAM
    if _TEAM is None:
        with _LOCK:
            if _TEAM is None:
                _TEAM = _Team()
    return _TEAM


def available() -> bool:
    """Whether the flush can be scoped to the kernels on this machine (x86-64 Linux, torch's GNU OpenMP)."""
    return _team().ready


def _wanted(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.is_floating_point()
        and not is_exporting()
        and os.environ.get(ENV_SWITCH, "1") != "0"
        and available()
    )


def _enter() -> ctypes.Array | None:
    """Flush on every team thread; the caller's environment to restore, or None where nothing was changed."""
    team = _team()
    saved = team.read()
    if saved is None or team.mxcsr(saved) & FLUSH_BITS == FLUSH_BITS:
        return None  # the caller flushes already: leave it as it is
    flushing = ctypes.create_string_buffer(saved.raw, _ENV_SIZE)
    struct.pack_into("<I", flushing, _MXCSR_OFFSET, team.mxcsr(saved) | FLUSH_BITS)
    team.write_all(flushing)
    return saved


def _leave(saved: ctypes.Array | None) -> None:
    if saved is not None:
        _team().write_all(saved)


@contextmanager
def flushed(tensor: torch.Tensor):
    """Flush-to-zero on the calling thread's team for the block, when ``tensor`` is computed on the CPU."""
    saved = _enter() if _wanted(tensor) else None
    try:
        yield
    finally:
        _leave(saved)


class _Scope:
    saved: ctypes.Array | None = None


class _BackwardEnd(torch.autograd.Function):
    # identity on the kernel's inputs: its backward runs after the kernel's, and restores the state
    @staticmethod
    def forward(ctx, scope, *tensors):
        ctx.scope = scope
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        _leave(ctx.scope.saved)
        ctx.scope.saved = None
        return (None, *grads)


class _BackwardStart(torch.autograd.Function):
    # identity on the kernel's output: its backward runs before the kernel's, and flushes
    @staticmethod
    def forward(ctx, scope, tensor):
        ctx.scope = scope
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.scope.saved = _enter()
        return None, grad


def bracket(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """``(q, k, v, close)``: the kernel's inputs, and ``close(output)`` for its output, so that its backward
    pass runs with flush-to-zero too (identities where no gradient is recorded or nothing is wanted).

    >>> q, k, v, close = bracket(q, k, v)  # doctest: +SKIP
    >>> out = close(kernel(q, k, v))  # doctest: +SKIP
    """
    tensors = (query, key, value)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors) and _wanted(query)):
        return query, key, value, _identity
    scope = _Scope()
    query, key, value = _BackwardEnd.apply(scope, *tensors)
    return query, key, value, lambda output: _BackwardStart.apply(scope, output)


def _identity(output):
    return output
