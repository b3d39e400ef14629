"""Process groups, sharding rules and vocab-parallel layers for models under
``torch.distributed`` (used by models and the engine; graphcap never imports this)."""

from .env import configure_nccl
from .group import ParallelGroup
from .launch import group_for_tp
from .sharding import head_slice, split_slice

__all__ = ["ParallelGroup", "configure_nccl", "group_for_tp", "head_slice", "split_slice"]
