"""Where kernels can run: the Triton backend check, the interpreter probe, and the logged-once notice.

The selection stage and cache writes run as Triton kernels or as their PyTorch implementations
(``BACKENDS``); attention admission (:mod:`qsa.attention.routing`) asks the same question before it
picks a Triton route. A fallback of ``route="auto"`` or of ``backend=None`` is logged once per process.
"""

from __future__ import annotations

import functools
import logging

import torch

from . import utils
from .utils import interpreter_enabled

logger = logging.getLogger("qsa")

_logged: set[str] = set()


def log_once(message: str) -> None:
    """Log ``message`` once per process at WARNING on the ``qsa`` logger: with no logging configured,
    Python's last-resort handler prints it to stderr, so a fallback of ``route="auto"`` is never silent."""
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)



NO_BACKEND_HINT = ("set TRITON_INTERPRET=1 before importing qsa to run the Triton kernels under the "
                   "interpreter, slowly, for testing")


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> str | None:
    """Why the Triton interpreter cannot run qsa's kernels here, or None; found by running a probe kernel
    once per process (only called with the interpreter on: the kernel is defined then).

    The probe does what every page4 kernel does and what broke under NumPy 2.4 with the Triton 3.6
    interpreter: a loop whose bounds are loaded from memory (the interpreter holds loaded scalars in
    1-element arrays and turns them into loop bounds with ``int()``, which NumPy 2.4 refuses)."""
    import numpy
    import triton
    import triton.language as tl

    @triton.jit
    def probe_kernel(bounds_ptr, out_ptr):
        start = tl.load(bounds_ptr)
        end = tl.load(bounds_ptr + 1)
        acc = tl.zeros((4,), dtype=tl.int32)
        for i in range(start, end):
            acc += i
        tl.store(out_ptr + tl.arange(0, 4), acc)

    bounds = torch.tensor([2, 5], dtype=torch.int32)
    out = torch.zeros(4, dtype=torch.int32)
    versions = f"numpy {numpy.__version__} with triton {triton.__version__}"
    try:
        probe_kernel[(1,)](bounds, out)
    except Exception as e:  # the interpreter wraps what failed (InterpreterError, TypeError, ...)
        detail = (str(e).strip().splitlines() or [""])[0][:160]
        return (f"the Triton interpreter cannot run qsa's kernels with {versions} ({type(e).__name__}: "
                f"{detail}); NumPy 2.4 and newer break it: pip install 'numpy<2.4'")
    if out.tolist() != [9] * 4:
        return (f"the Triton interpreter computes a loop with bounds loaded from memory wrongly with {versions} "
                f"(got {out.tolist()}, want [9, 9, 9, 9]); NumPy 2.4 and newer break it: pip install 'numpy<2.4'")
    return None


def triton_available(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device``, or None. Under the interpreter (``TRITON_INTERPRET=1``)
    the interpreter must also run a probe kernel with the installed NumPy (:func:`interpreter_problem`)."""
    if interpreter_enabled():
        problem = interpreter_problem()
        if problem is not None:
            return problem
    if device.type == "cuda":
        cap = utils.device_facts(str(device))["capability"]
        if cap < (8, 0):
            return f"compute capability {cap} is below 8.0"
        return None
    if interpreter_enabled():
        return None
    return f"no Triton backend for device {device.type}; {NO_BACKEND_HINT}"


BACKENDS = ("triton", "torch")
"""How the selection stage and cache writes run: Triton kernels, or their PyTorch implementations."""


def kernel_backend(route: str, device) -> str:
    """``"torch"`` for the reference route or where Triton cannot run on ``device``, else ``"triton"``."""
    if route == "reference" or triton_available(torch.device(device)) is not None:
        return "torch"
    return "triton"


def resolve_backend(backend: str | None, device) -> str:
    """``backend``, or the one :func:`kernel_backend` picks for ``device`` when it is None."""
    if backend is None:
        return kernel_backend("auto", device)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton":
        why = triton_available(torch.device(device))
        if why is not None:
            raise ValueError(f"backend='triton' cannot run: {why}")
    return backend

