"""The step vocabulary: what a caller hands a runner for one step (``TokenChunk``), and the
token ids of a step that already live on the device (``TokenFeed``). Imported by the engine,
the attention metadata and the runners alike; imports nothing of theirs."""

from .chunks import TokenChunk, TokenFeed

__all__ = ["TokenChunk", "TokenFeed"]
