"""A vLLM plugin that serves vLLM's QSA attention op with qsa's kernels, when asked to.

vLLM loads the entry points of its ``vllm.general_plugins`` group in every process (engine and workers)
before it builds a model; qsa's ``pyproject.toml`` declares one, ``qsa = "qsa.integrations.vllm_plugin:register"``,
so installing qsa in vLLM's environment is enough for vLLM to call :func:`register`. It does nothing unless
the environment variable ``QSA_VLLM`` is ``1`` (or ``true``, ``yes``, ``on``) in that process.

When enabled, :func:`register` imports vLLM's QSA op module, ``vllm.models.qwen4_exp.nvidia.ops.qsa``, and
replaces that module's ``qsa_sparse_paged_attention`` with :func:`qsa.integrations.vllm.qsa_sparse_paged_attention`
(same arguments, layouts and results; see that module), behind a thin function that logs once per process,
at its first call, that qsa serves the op, qsa's version and the route qsa's ``auto`` takes for that call
(qsa picks the route per call from the batch). vLLM 0.33.0's model (``Qwen4ExpQSAFlashAttentionImpl.forward_qsa``
in ``vllm.models.qwen4_exp.nvidia.qsa``) imports the name from the op module inside the method, at every
call, so it finds the replacement; a module of ``vllm.*`` that bound the name before the plugin ran (at
its import, ``from ...ops.qsa import qsa_sparse_paged_attention``) is rebound too, and one imported later
binds the replacement anyway. Nothing else changes: the indexer (selection), the expand step that writes
``logical_indices``, the cache writes, the metadata and the model stay vLLM's.

When vLLM, or its qwen4_exp model, is not installed, or the variable is unset, :func:`register` changes
nothing and raises nothing (a DEBUG line on the ``qsa.integrations.vllm_plugin`` logger says why). Calling it
again is harmless (vLLM may load plugins more than once per process). Importing qsa never imports vLLM;
only :func:`register`, when enabled, does.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading

__all__ = ["ENV_VAR", "OP_MODULE", "OP_NAME", "enabled", "register", "unregister"]

ENV_VAR = "QSA_VLLM"
"""The environment variable that enables the plugin (off unless it is 1, true, yes or on)."""
OP_MODULE = "vllm.models.qwen4_exp.nvidia.ops.qsa"
"""vLLM's QSA op module (vLLM 0.33.0)."""
OP_NAME = "qsa_sparse_paged_attention"
"""The op's name, in its module and wherever a module of ``vllm.*`` bound it."""
MODEL_MODULE = "vllm.models.qwen4_exp.nvidia.qsa"
"""Where vLLM 0.33.0's model calls the op (``Qwen4ExpQSAFlashAttentionImpl.forward_qsa``, by a
function-local import from :data:`OP_MODULE`)."""
TRUE = ("1", "true", "yes", "on")

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_first_call_logged = False


def enabled() -> bool:
    """Whether ``QSA_VLLM`` asks for qsa (``1``, ``true``, ``yes`` or ``on``, any case)."""
    return os.environ.get(ENV_VAR, "").strip().lower() in TRUE


def register() -> None:
    """vLLM's plugin hook: when enabled, serve vLLM's QSA op with qsa's drop-in (module docstring)."""
    if not enabled():
        logger.debug("%s is not set: vLLM's QSA op is left as it is", ENV_VAR)
        return
    try:
        op_module = importlib.import_module(OP_MODULE)
    except ImportError as e:
        logger.debug("%s is set but vLLM's QSA op module %s cannot be imported (%s): nothing to replace",
                     ENV_VAR, OP_MODULE, e)
        return
    except Exception as e:  # noqa: BLE001 - a plugin must not stop vLLM; its own op stays
        logger.warning("%s is set but importing %s failed (%s: %s): vLLM's own QSA op stays", ENV_VAR, OP_MODULE,
                       type(e).__name__, e)
        return
    with _lock:
        current = vars(op_module).get(OP_NAME)
        if current is None:
            logger.debug("%s has no %s: nothing to replace", OP_MODULE, OP_NAME)
            return
        if getattr(current, "_qsa_serves_vllm", False):  # already registered in this process
            return
        from .vllm import qsa_sparse_paged_attention as adapter

        served = _serving(adapter, current)
        rebound = [OP_MODULE]
        setattr(op_module, OP_NAME, served)
        for name, mod in list(sys.modules.items()):
            if mod is None or mod is op_module or not name.startswith("vllm."):
                continue
            try:
                bound = vars(mod).get(OP_NAME)  # vars(): no module __getattr__ runs
            except TypeError:
                continue
            if bound is current:
                setattr(mod, OP_NAME, served)
                rebound.append(name)
    _ensure_visible()
    logger.debug("%s: qsa's drop-in now stands for %s in %s", ENV_VAR, OP_NAME, ", ".join(rebound))


def unregister() -> None:
    """Put vLLM's op back wherever :func:`register` put qsa's (for tests and experiments)."""
    global _first_call_logged
    mod = sys.modules.get(OP_MODULE)
    served = vars(mod).get(OP_NAME) if mod is not None else None
    original = getattr(served, "vllm_op", None)
    if original is None:
        return
    with _lock:
        for name, m in list(sys.modules.items()):
            if m is not None and name.startswith("vllm."):
                try:
                    if vars(m).get(OP_NAME) is served:
                        setattr(m, OP_NAME, original)
                except TypeError:
                    continue
        _first_call_logged = False


def _serving(adapter, original):
    """``adapter`` under vLLM's op's name, logging at its first call in the process which route serves it."""

    def qsa_sparse_paged_attention(q, k_cache, v_cache, logical_indices, block_table, token_to_req,
                                   use_prefill_config, out=None, k_scale=None, v_scale=None, *, output_gate):
        if not _first_call_logged:
            _log_first_call(q, k_cache, logical_indices, block_table, use_prefill_config)
        return adapter(q, k_cache, v_cache, logical_indices, block_table, token_to_req, use_prefill_config, out,
                       k_scale, v_scale, output_gate=output_gate)

    qsa_sparse_paged_attention.__module__ = __name__
    qsa_sparse_paged_attention.__qualname__ = OP_NAME
    qsa_sparse_paged_attention.__doc__ = (f"vLLM's {OP_NAME} served by qsa (qsa.integrations.vllm_plugin): "
                                          "qsa.integrations.vllm.qsa_sparse_paged_attention.")
    qsa_sparse_paged_attention._qsa_serves_vllm = True
    qsa_sparse_paged_attention.vllm_op = original   # what it replaced (unregister puts it back)
    qsa_sparse_paged_attention.qsa_op = adapter
    return qsa_sparse_paged_attention


def _log_first_call(q, k_cache, logical_indices, block_table, use_prefill_config) -> None:
    """Once per process: qsa serves the op, its version, and the route ``auto`` takes for this call."""
    global _first_call_logged
    with _lock:
        if _first_call_logged:
            return
        _first_call_logged = True
    from .. import __version__

    try:
        route = _route_of(q, k_cache, logical_indices, block_table, use_prefill_config)
    except Exception as e:  # noqa: BLE001 - the notice must never fail the call; the call reports bad input
        route = f"not known ({type(e).__name__})"
    logger.info("qsa %s serves vLLM's QSA attention op (%s.%s, %s=1, pid %d); its first call, %d rows, "
                "use_prefill_config=%s, takes qsa's %s route (qsa picks the route per call)", __version__,
                OP_MODULE, OP_NAME, ENV_VAR, os.getpid(), q.shape[0], use_prefill_config, route)


def _route_of(q, k_cache, logical_indices, block_table, use_prefill_config) -> str:
    """The route qsa's ``auto`` takes for a call with the hints the drop-in passes."""
    from ..attention.routing import choose

    rows, hq, d = q.shape
    rp = choose("auto", rows=rows, G=max(hq // max(k_cache.shape[2], 1), 1), head_dim=d, device=q.device,
                max_query_len=None if use_prefill_config else 1, rows_sorted=True,
                index_width=logical_indices.shape[1] - 1, context_tokens=block_table.shape[1] * k_cache.shape[1])
    if rp.route == "grouped" and 0 < rp.grouped_rows < rows:
        return f"grouped ({rp.grouped_rows} rows) + xqa ({rows - rp.grouped_rows} rows{', direct' if rp.direct else ''})"
    return rp.route + (" (direct)" if rp.route == "xqa" and rp.direct else "")


def _ensure_visible() -> None:
    """The first-call notice is INFO: with no handler configured for it (vLLM configures only its own
    ``vllm`` logger), give this logger one on stderr, so the notice shows in every vLLM process."""
    if logger.level == logging.NOTSET and logger.getEffectiveLevel() > logging.INFO:  # a set level stays
        logger.setLevel(logging.INFO)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [qsa] %(message)s"))
        logger.addHandler(handler)
