"""Replayed steps: an eager call's kernel launches, recorded once per shape and launched again with new inputs.

Called eagerly, the op's host time goes to work that is the same on every call of one shape: checking
the arguments, choosing routes and settings, and Triton's binding of every kernel argument. The first
call of a shape runs the full path inside a :class:`Recorder`: every launch goes through :func:`launch`,
which records the kernel, its grid and its arguments, and every fill of a buffer the step owns through
:func:`zeroed`. The record becomes a :class:`Replay` only if every tensor argument of every launch is
either one of the call's named inputs (matched by its data pointer) or a buffer the step owns (its plan's
work lists, partials and scratch, and buffers registered with :func:`owned`); anything else (a
temporary such as a negated ``q``) leaves the shape unreplayed, on the full path.

A later call whose fingerprint (:func:`tensor_key` of every input, the scalars, the stream, the settings)
equals the record's launches the same compiled kernels with the inputs' new data pointers: on the GPU one
call per launch of the compiled kernel's C launcher, with every argument but the pointers prepared when
the step was recorded (a kernel that needs Triton's per-launch scratch goes through Triton's launcher
object instead). A compiled kernel assumes what Triton specialised it on: the argument dtypes and
integers (all fixed by the fingerprint) and each pointer's 16-byte alignment, which a replay checks
before it launches anything (a misaligned input takes the full path).

A replay reuses its step's buffers: calls on one stream are ordered, so a call's buffers are free when
the next call's launches run. The stream is part of the fingerprint (another stream gets its own
buffers), and nothing is recorded or replayed during CUDA-graph capture.
"""

from __future__ import annotations

import functools
import operator
import threading
from collections import OrderedDict
from dataclasses import fields, is_dataclass

import torch

from .. import backend, settings, utils

ON_INTERPRETER = False
"""Replay under the Triton interpreter too (the CPU tests of this module set it); on the GPU always."""

_local = threading.local()


class Uncacheable(Exception):
    """A record that cannot become a replay (an argument that is neither an input nor owned)."""


class Recorder:
    """Collects the launches and fills of one call (``with Recorder() as rec:``)."""

    def __init__(self):
        self.steps = []  # ("launch", kernel, grid, args, kwargs, compiled) or ("zero", tensor)
        self.owned = []

    def __enter__(self):
        self._outer = getattr(_local, "recorder", None)
        _local.recorder = self
        return self

    def __exit__(self, *exc):
        _local.recorder = self._outer
        return False


def recording() -> Recorder | None:
    return getattr(_local, "recorder", None)


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, recorded when a :class:`Recorder` is active. Positional
    arguments are the kernel's runtime arguments, keywords its constexprs and launch options."""
    compiled = kernel[grid](*args, **kwargs)
    rec = getattr(_local, "recorder", None)
    if rec is not None:
        rec.steps.append(("launch", kernel, tuple(grid), args, kwargs, compiled))
    return compiled


def owned(t: torch.Tensor) -> torch.Tensor:
    """Register ``t`` as a buffer of the step being recorded (scratch that every call writes before it
    reads it): a replay keeps and reuses it."""
    rec = getattr(_local, "recorder", None)
    if rec is not None:
        rec.owned.append(t)
    return t


def zeroed(t: torch.Tensor) -> torch.Tensor:
    """Zero ``t`` (a buffer of the step) now, and on every replay at this point of the step."""
    t.zero_()
    rec = getattr(_local, "recorder", None)
    if rec is not None:
        rec.owned.append(t)
        rec.steps.append(("zero", t))
    return t


def tensors_of(obj, found: list, depth: int = 0) -> list:
    """Every tensor held by ``obj`` (dataclasses, lists, tuples and dicts, a few levels deep)."""
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif depth > 4 or obj is None:
        pass
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            tensors_of(getattr(obj, f.name), found, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            tensors_of(x, found, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            tensors_of(x, found, depth + 1)
    return found


class _Launch:
    __slots__ = ("kernel", "grid", "kwargs", "template", "slots", "call")


def _launcher(compiled, grid: tuple, stream: int) -> tuple:
    """(callable, argument prefix) that launch ``compiled`` on ``grid`` and ``stream`` when called with the
    prefix followed by the kernel's arguments.

    Triton 3.6's launcher object (``compiled.run``) allocates the kernel's global and profile scratch per
    launch and then calls its C ``launch`` with the grid, the stream, the function, the cooperative-grid and
    programmatic-dependent-launch flags, the two scratch pointers, the packed metadata, the launch
    metadata and the two launch hooks. A kernel with no scratch is launched through that C function
    directly (no hooks: a replay is only used with none set, see :func:`context`); any other through the
    launcher object, as Triton's own launch calls it."""
    g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    run = compiled.run
    direct = getattr(run, "launch", None)
    if direct is not None and getattr(run, "global_scratch_size", None) == 0 \
            and getattr(run, "profile_scratch_size", None) == 0:
        return direct, [*g, stream, compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                        compiled.packed_metadata, None, None, None]
    return run, [*g, stream, compiled.function, compiled.packed_metadata, None, None, None]


STREAM_SLOT = 3
"""Where the stream is in a launcher's argument prefix (:func:`_launcher`)."""


class Replay:
    """A recorded step: its launches, with the input slots of each, and the buffers it owns."""

    def __init__(self, rec: Recorder, inputs: dict, keep: list, cuda: bool, device_index: int = 0,
                 stream: int = 0):
        by_ptr = {}
        for name, t in inputs.items():
            if t is None:
                continue
            p = t.data_ptr()
            if p == 0 or p in by_ptr:
                raise Uncacheable(f"input {name} shares its data pointer with {by_ptr.get(p)}")
            by_ptr[p] = name
        keep = [t for t in keep + rec.owned if t.data_ptr() not in by_ptr]  # the inputs are not held
        own = {t.data_ptr() for t in keep}
        self.keep = keep  # alive as long as the replay
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in keep}
        self.nbytes = sum(storages.values())  # the device memory the replay holds
        self.cuda = cuda
        self.inputs_order = tuple(inputs)  # the order of :meth:`launch`'s values
        self.aligned = set()  # inputs whose pointer a compiled kernel takes as 16-byte aligned
        self.names = set()
        self.steps = []
        for step in rec.steps:
            if step[0] == "zero":
                self.steps.append(step)
                continue
            _, kernel, grid, args, kwargs, compiled = step
            if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
                raise Uncacheable(f"{kernel.fn.__name__} takes a tensor by keyword")
            slots = []
            for i, a in enumerate(args):
                if not isinstance(a, torch.Tensor):
                    continue
                p = a.data_ptr()
                name = by_ptr.get(p)
                if name is None:
                    if p not in own:
                        raise Uncacheable(f"argument {i} of {kernel.fn.__name__} is neither an input nor owned")
                    continue
                slots.append((i, name, a.dtype))
                self.names.add(name)
                if p % 16 == 0:
                    self.aligned.add(name)
            L = _Launch()
            L.kernel, L.grid, L.kwargs, L.slots = kernel, grid, kwargs, slots
            if cuda:
                caches = getattr(kernel, "device_caches", None)  # a Triton JIT function's; a stand-in has none
                if caches is None or device_index not in caches or not hasattr(compiled, "run"):
                    raise Uncacheable(f"{type(kernel).__name__} is not a compiled Triton kernel")
                binder = caches[device_index][4]
                bound, _, _ = binder(*args, **kwargs)
                L.call, prefix = _launcher(compiled, grid, stream)
                template = prefix + list(bound.values())
                for j, v in enumerate(template):
                    if isinstance(v, torch.Tensor):
                        template[j] = v.data_ptr()
                L.template = template
                L.slots = [(i + len(prefix), name) for i, name, _ in slots]
            else:
                L.template = list(args)
            self.steps.append(("launch", L))
        self._gather()

    def _gather(self) -> None:
        """Prepare :meth:`launch`: where each input the launches read sits among its values
        (:attr:`inputs_order`), and on the GPU path each launch's arguments picked in one C call
        (``operator.itemgetter``) from one list, the inputs' pointers (in :attr:`order`), the stream, then
        every launch's recorded arguments."""
        self.order = tuple(sorted(self.names))
        at = {name: j for j, name in enumerate(self.inputs_order)}
        self.at = at
        self.pick = _picker([at[name] for name in self.order])
        if not self.cuda:
            return
        where = {name: j for j, name in enumerate(self.order)}
        self.aligned_at = tuple(where[name] for name in self.order if name in self.aligned)
        self.fixed = []
        base = len(self.order) + 1
        self.calls = []
        for step in self.steps:
            if step[0] == "zero":
                self.calls.append((None, step[1]))
                continue
            L = step[1]
            picks = [base + len(self.fixed) + j for j in range(len(L.template))]
            picks[STREAM_SLOT] = len(self.order)
            for i, name in L.slots:
                picks[i] = where[name]
            self.fixed += L.template
            self.calls.append((L.call, operator.itemgetter(*picks)))

    def drop_input(self, name: str) -> None:
        """Launch the recorded pointer in place of input ``name`` from now on: a stale replay, for the
        known-wrong variants of the tests that must catch one."""
        for step in self.steps:
            if step[0] == "launch":
                step[1].slots = [s for s in step[1].slots if s[1] != name]
        self.names.discard(name)
        self._gather()

    def drop_launch(self, index: int) -> None:
        """Leave out step ``index`` (a launch) from now on: a replay that skips one, for the known-wrong
        variants of the tests that must catch one."""
        if self.steps[index][0] != "launch":
            raise ValueError(f"step {index} is not a launch")
        del self.steps[index]
        self._gather()

    def __call__(self, inputs: dict, stream: int) -> bool:
        """Launch the step on ``inputs`` (name -> tensor or None, every name the record had); False,
        launching nothing, where an input's alignment differs from what the compiled kernels assume."""
        return self.launch(tuple(map(inputs.__getitem__, self.inputs_order)), stream)

    def launch(self, values: tuple, stream: int) -> bool:
        """:meth:`__call__` with the inputs as a tuple in the order of the record's (:attr:`inputs_order`),
        which spares the caller a dict. On the GPU path a value may also be an int, the input's data pointer
        read earlier (a caller that holds it spares the read)."""
        if self.cuda:
            ptrs = [t if t.__class__ is int else t.data_ptr() for t in self.pick(values)]
            for j in self.aligned_at:
                if ptrs[j] & 15:
                    return False
            ptrs.append(stream)
            ptrs += self.fixed
            for call, pick in self.calls:
                if call is None:
                    pick.zero_()  # a buffer the step owns, zeroed before the launches that count into it
                else:
                    call(*pick(ptrs))
            return True
        at = self.at
        for step in self.steps:
            if step[0] == "zero":
                step[1].zero_()
                continue
            L = step[1]
            args = L.template.copy()
            for i, name, dtype in L.slots:
                t = values[at[name]]
                args[i] = t if t.dtype == dtype else t.view(dtype)
            L.kernel[L.grid](*args, **L.kwargs)
        return True


def _picker(positions: list):
    """A function taking a tuple to the tuple of its items at ``positions`` (one C call where there are
    two or more)."""
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    if positions:
        j = positions[0]
        return lambda values: (values[j],)
    return lambda values: ()


def replay_of(rec: Recorder, inputs: dict, keep: list, device: torch.device, stream: int) -> Replay | None:
    """The launches ``rec`` recorded on ``stream`` as a :class:`Replay` of ``inputs`` keeping ``keep``
    alive (the compiled path on a GPU, the interpreter's otherwise), or None where they cannot be replayed."""
    try:
        return Replay(rec, inputs, keep, cuda=device.type == "cuda" and not backend.interpreter_enabled(),
                      device_index=device.index or 0, stream=stream)
    except Uncacheable:
        return None


def shares_pointers(inputs: dict) -> bool:
    """Whether two of ``inputs`` (name -> tensor or None) start at one address, which a :class:`Replay`
    refuses. A caller may serve such a call unrecorded and leave its fingerprint open to distinct tensors."""
    ptrs = [p for p in (t.data_ptr() for t in inputs.values() if t is not None) if p]
    return len(set(ptrs)) < len(ptrs)


PLAIN = frozenset((float, int, bool, str, type(None)))
"""Types of the scalars a fingerprint holds: compared by value (a tensor would compare by identity)."""


def tensor_key(t):
    """What a replay depends on in a tensor: shape, strides, dtype and device (None for None)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.get_device())


_variables = utils.environment_reader("TRITON_INTERPRET", "QSA_PDL")
"""The values of ``TRITON_INTERPRET`` and ``QSA_PDL`` now (what the launchers read)."""


def environment(variables: tuple | None = None) -> tuple:
    """What every replay depends on besides its inputs: the settings (their change counter,
    ``settings.CHANGES``), the device facts, the backend and the environment variables the launchers read
    (a change of any of them, tests' patches included, drops every replay). ``variables``: those
    variables' values where the caller has read them."""
    return (settings.CHANGES, utils.device_facts, backend.interpreter_enabled, backend.triton_available,
            variables if variables is not None else _variables())


def context(device: torch.device) -> tuple[int, tuple] | None:
    """(stream, :func:`environment`) of a call on ``device`` that may record and replay now, or None: a GPU
    outside CUDA-graph capture with no Triton launch hooks, or the interpreter where
    :data:`ON_INTERPRETER` allows it, and no :class:`Recorder` active (an outer recording sees every launch
    of the calls inside it, none of them served by a replay of its own). The stream is the device's current raw stream (0 under the
    interpreter). The environment is read once here, for the whole call."""
    if not settings.REPLAY_STEPS or getattr(_local, "recorder", None) is not None:
        return None  # inside a recording the launches go to it, as they are
    variables = _variables()
    kind = device.type
    if variables[0] not in utils.OFF_VALUES:  # the interpreter
        if not ON_INTERPRETER or kind not in ("cuda", "cpu"):
            return None
        return 0, environment(variables)
    if kind != "cuda":
        return None
    index = device.index
    return _gpu_context(index if index is not None else torch.cuda.current_device(), variables)


def context_of(t: torch.Tensor) -> tuple[int, tuple] | None:
    """:func:`context` of a call on ``t``'s device, read from the tensor without making a
    ``torch.device``."""
    if not settings.REPLAY_STEPS or getattr(_local, "recorder", None) is not None:
        return None
    variables = _variables()
    if variables[0] not in utils.OFF_VALUES or not t.is_cuda:
        return context(t.device)
    return _gpu_context(t.get_device(), variables)


def _gpu_context(index: int, variables: tuple) -> tuple[int, tuple] | None:
    """:func:`context` on GPU ``index`` outside the interpreter, ``variables`` read: None during CUDA-graph
    capture or with a Triton launch hook set."""
    if torch._C._cuda_isCurrentStreamCapturing():
        return None
    runtime = _triton_runtime()
    if not (_unhooked(runtime.launch_enter_hook) and _unhooked(runtime.launch_exit_hook)):
        return None
    return torch._C._cuda_getCurrentRawStream(index), environment(variables)


def _unhooked(hook) -> bool:
    """Whether a Triton launch hook is unset: None, or a hook chain with no calls (Triton 3.6)."""
    return hook is None or not getattr(hook, "calls", True)


@functools.lru_cache(maxsize=None)
def _triton_runtime():
    """Triton's runtime knobs (its launch hooks: a profiler that sets them sees every launch, so a
    replay, which bypasses them, is not used then)."""
    from triton import knobs

    return knobs.runtime


class ReplayCache:
    """Replays by fingerprint, the least recently used dropped past ``settings.REPLAY_CACHE_SIZE`` entries
    or past ``settings.REPLAY_CACHE_BYTES`` of buffers held (the newest is always kept); a key that could
    not be replayed maps to None (its calls take the full path without recording again). ``hits`` counts
    the calls a replay served (:meth:`serve`), not those it refused.

    The entry got or put last is also held beside the table: a call with its key (the usual case, one
    layout called again and again) is answered by comparing the two keys, without hashing the new one."""

    def __init__(self):
        self.entries = OrderedDict()
        self.env = None
        self.hits = 0
        self.nbytes = 0
        self.last_key = self.last = None

    def get(self, key, env: tuple):
        """The entry of ``key`` (a Replay, or None), or the cache itself where ``key`` was never seen;
        ``env`` (:func:`environment`) unlike the last one drops every entry first."""
        if env != self.env:
            self.clear()
            self.env = env
        elif key == self.last_key:
            return self.last  # already the most recently used
        entry = self.entries.get(key, self)
        if entry is not self:
            self.entries.move_to_end(key)
            self.last_key, self.last = key, entry
        return entry  # self: never seen

    def serve(self, entry, inputs: dict, stream: int) -> bool:
        """Launch ``entry`` (a :class:`Replay` from :meth:`get`) on ``inputs``: True where it launched, counted
        in :attr:`hits`; False where it refused (an input aligned otherwise than the recorded one's) and
        launched nothing."""
        if entry(inputs, stream):
            self.hits += 1
            return True
        return False

    def serve_values(self, entry, values: tuple, stream: int) -> bool:
        """:meth:`serve` with the inputs as a tuple in the record's order (:meth:`Replay.launch`)."""
        if entry.launch(values, stream):
            self.hits += 1
            return True
        return False

    def put(self, key, replay) -> None:
        old = self.entries.pop(key, None)
        self.nbytes -= getattr(old, "nbytes", 0)
        self.entries[key] = replay
        self.nbytes += getattr(replay, "nbytes", 0)
        self.last_key, self.last = key, replay
        while len(self.entries) > 1 and (len(self.entries) > settings.REPLAY_CACHE_SIZE
                                         or self.nbytes > settings.REPLAY_CACHE_BYTES):
            _, dropped = self.entries.popitem(last=False)
            self.nbytes -= getattr(dropped, "nbytes", 0)

    def clear(self) -> None:
        self.entries.clear()
        self.hits = 0
        self.nbytes = 0
        self.last_key = self.last = None
