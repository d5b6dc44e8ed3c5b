"""The ``qsa`` command: ``info``, ``demo`` (:mod:`.demo`), ``verify`` (:mod:`.verify`) and ``bench``."""

from .commands import main

__all__ = ["main"]
