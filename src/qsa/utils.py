"""Small shared helpers: interpreter detection, argument checks, device facts."""

from __future__ import annotations

import functools
import math
import numbers
import os

import numpy as np
import torch

INT32_MAX = 2**31 - 1


def environment_reader(*names: str):
    """A function returning the values of the environment variables ``names`` now, as a tuple. On POSIX it
    reads ``os.environ``'s own mapping of encoded names (which every change through ``os.environ``, tests'
    patches included, updates in place), so a read costs a dict lookup per name instead of an encoding
    and a decoding (values come back as bytes there, as str elsewhere: compare against both)."""
    data = getattr(os.environ, "_data", None)
    if os.name == "posix" and isinstance(data, dict):
        keys = tuple(os.environ.encodekey(name) for name in names)
        return lambda: tuple(map(data.get, keys))
    return lambda: tuple(map(os.environ.get, names))


OFF_VALUES = (None, "", "0", b"", b"0")
"""Values of a flag variable that leave it off, read as str or as encoded bytes (:func:`environment_reader`)."""

_interpret = environment_reader("TRITON_INTERPRET")


def interpreter_enabled() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return _interpret()[0] not in OFF_VALUES


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels must feed ``tl.dot`` fp32 operands instead of ``dtype``.

    The Triton interpreter (3.6 to 3.9) multiplies the raw bit patterns of bfloat16 ``tl.dot``
    operands (triton-lang/triton#11584), so under the interpreter bf16 operands are upcast first.
    On a GPU the real bf16 tensor-core dot is used.
    """
    return interpreter_enabled() and dtype == torch.bfloat16


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``); ``n`` is an int (:func:`check_int`)."""
    n = check_int("n", n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def round_up(n: int, m: int) -> int:
    return (int(n) + m - 1) // m * m


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None, device=None,
                 shape: tuple | None = None, what: str = "") -> None:
    """Raise TypeError/ValueError naming ``name`` when ``t`` is not the tensor described.

    ``shape`` may hold ``None`` for free dimensions; ``what`` is the expected layout, e.g.
    ``"[rows, Hq, D]"``, quoted in messages.
    """
    desc = f" {what}" if what else ""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{desc}, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes) if isinstance(dtypes, (tuple, list, set)) else (dtypes,)
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} must have dtype {names}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D{desc}, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}{desc}, got {tuple(t.shape)}")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def type_name(x) -> str:
    """The name of ``x``'s type for an error message: ``int``, ``numpy.float32``, ``torch.Tensor``."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_bool(name: str, x) -> bool:
    """``x`` as a python bool (a python or numpy bool; not an int, a string or a tensor)."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type_name(x)}")
    return bool(x)


def check_int(name: str, x, least: int | None = None) -> int:
    """``x`` as an int (a python or numpy integer, not a bool), at least ``least`` when given."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type_name(x)}")
    if least is not None and x < least:
        raise ValueError(f"{name} must be an int >= {least}, got {x}")
    return int(x)


def as_finite_float(name: str, x) -> float:
    """``x`` as a finite python float (a number or a CPU scalar tensor, not a bool)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(x.shape)}")
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be a python float or a CPU scalar tensor (no device sync)")
        if x.dtype == torch.bool:
            raise TypeError(f"{name} must be a float, got a bool tensor")
        if x.dtype.is_complex:
            raise TypeError(f"{name} must be a real float, got a {str(x.dtype).replace('torch.', '')} tensor")
    elif isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type_name(x)}")
    try:
        value = float(x)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got a value too large for a float") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_positive_float(name: str, x) -> None:
    """``x`` is a finite number > 0 held on the host (not a bool, not a tensor)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a python float (a host value, no device tensor), got {type(x).__name__}")
    try:
        value = float(x)
    except OverflowError:
        raise ValueError(f"{name} must be finite and > 0, got a value too large for a float") from None
    if not (0.0 < value < float("inf")):
        raise ValueError(f"{name} must be finite and > 0, got {x}")


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: its dimensions of more than one element, by
    increasing stride, must each step over the whole extent of the ones before (conservative: a layout
    that interleaves dimensions without overlap also counts as overlapping). A tensor with no elements
    overlaps nothing."""
    if t.numel() == 0:
        return False
    extent = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride < extent:
            return True
        extent = stride * size
    return False


def int_at_least(least: int):
    """An ``argparse`` type: an int >= ``least``."""
    def parse(text: str) -> int:
        import argparse

        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {least}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be an int >= {least}, got {value}")
        return value

    parse.__name__ = f"int >= {least}"
    return parse


def int_in_range(least: int, most: int):
    """An ``argparse`` type: an int in ``[least, most]``."""
    def parse(text: str) -> int:
        import argparse

        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int in [{least}, {most}], got {text!r}") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be an int in [{least}, {most}], got {value}")
        return value

    parse.__name__ = f"int in [{least}, {most}]"
    return parse


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""Range of the commands' ``--seed``: a signed 64-bit int, inside what ``torch.Generator.manual_seed``
takes ([-2**63, 2**64 - 1]) with room for the per-layer seeds ``seed + 1 + i``."""


def cli_device(parser, text: str) -> torch.device:
    """``--device`` of the commands: "auto" (the GPU if there is one), "cpu", or a CUDA device that exists."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        parser.error(f"--device must be auto, cpu or cuda, got {text!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be auto, cpu or cuda, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {text}: no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        parser.error(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def same_device(device_a: torch.device, device_b: torch.device) -> bool:
    a, b = torch.device(device_a), torch.device(device_b)
    if a.type != b.type:
        return False
    if a.type == "cuda":
        ia = a.index if a.index is not None else torch.cuda.current_device()
        ib = b.index if b.index is not None else torch.cuda.current_device()
        return ia == ib
    return True


def dependent_launch(device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch (PDL, sm_90 and newer):
    a kernel's programs may start while the previous kernel on the stream finishes, and wait for its
    writes before their first global access. ``QSA_PDL=0`` turns it off; never under the interpreter."""
    if interpreter_enabled() or os.environ.get("QSA_PDL", "1") == "0":
        return False
    facts = device_facts(str(torch.device(device)))
    return facts["kind"] == "cuda" and facts["capability"] >= (9, 0)


def launch_options(device, *, early_trigger: bool = True) -> dict:
    """Keyword arguments every kernel launch takes: programmatic dependent launch where supported
    (:func:`dependent_launch`), the kernel waiting for its predecessor in ``enter_launch``. With
    ``early_trigger`` the next kernel may begin launching as soon as every program of this one has
    started; without, when they have all exited."""
    pdl = dependent_launch(device)
    return dict(PDL=(1 if early_trigger else 2) if pdl else 0, launch_pdl=pdl)


@functools.lru_cache(maxsize=None)
def device_facts(device: str) -> dict:
    """Facts the launchers and admission need: SM count, compute capability, shared memory."""
    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return {
            "name": props.name,
            "kind": "cuda",
            "capability": (props.major, props.minor),
            "sm_count": props.multi_processor_count,
            "shared_memory_per_block_optin": getattr(props, "shared_memory_per_block_optin", 0),
            "total_memory": props.total_memory,
        }
    return {"name": "cpu", "kind": "cpu", "capability": None, "sm_count": os.cpu_count() or 1,
            "shared_memory_per_block_optin": 0, "total_memory": 0}
