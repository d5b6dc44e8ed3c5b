"""qsa behind the interfaces of serving engines.

* :mod:`.vllm` -- ``qsa_sparse_paged_attention``, a drop-in for vLLM's QSA attention op (same arguments,
  layouts and results), and :class:`~qsa.integrations.vllm.ForwardPlans`, the per-forward plan reuse an
  engine can add for CUDA-graph capture of a whole forward.
* :mod:`.vllm_plugin` -- the ``vllm.general_plugins`` entry point that, when enabled, puts that drop-in in
  place of vLLM's op.

Nothing here imports an engine at import time: importing ``qsa``, ``qsa.integrations`` or
``qsa.integrations.vllm`` never imports ``vllm``. The submodules are not imported by this package; import
the one you need.
"""
