"""The model side: the QSA attention layer (:mod:`.layer`, its math in :mod:`.functional`, its reference in
:mod:`.reference`), the tiny model (:mod:`.tiny`), the serving loop (:mod:`.serving`), tensor parallelism
(:mod:`.tp`) and the ``torch.ops.qsa`` custom ops (:mod:`.ops`)."""

from . import ops  # noqa: F401  (registers torch.ops.qsa.*)
from .layer import LayerCache, QSAAttention, QSAConfig, StepMetadata
from .serving import Engine, GenerationResult, ServingConfig, run_layer
from .tiny import TinyConfig, TinyQSAModel
from .tp import TPInfo, shard_heads

__all__ = ["Engine", "GenerationResult", "LayerCache", "QSAAttention", "QSAConfig", "ServingConfig", "StepMetadata",
           "TPInfo", "TinyConfig", "TinyQSAModel", "run_layer", "shard_heads"]
