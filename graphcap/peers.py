"""Agreement among the ranks that capture together (tensor parallelism).

Every rank replays the same graphs in the same order, and a graph holds collectives: if one
rank dropped a bucket that another replays, their collectives would no longer pair up and both
would hang. So every decision that removes a graph (a capture that failed, splices not
graph-safe for a decode graph, a failed validation, a frozen host value) is taken as the
union over the ranks, and the bucket lists must be equal before anything is captured.

graphcap stays free of ``torch.distributed``: the caller passes ``gather(obj) -> [obj of rank
0, obj of rank 1, ...]`` (e.g. ``ParallelGroup.gather_object``); a single process gathers
``[obj]``.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

Gather = Callable[[Any], list[Any]]


def single_process(obj: Any) -> list[Any]:
    return [obj]


class Peers:
    """The host-side agreements of one ``CaptureManager`` (see the module docstring)."""

    def __init__(self, gather: Gather | None = None) -> None:
        self.gather = gather or single_process

    def union(self, failures: dict[Hashable, str]) -> dict[Hashable, str]:
        """Every rank's failures (key -> reason); a reason from other ranks names them."""
        everyone = self.gather(dict(failures))
        if len(everyone) == 1:
            return dict(failures)
        out: dict[Hashable, str] = {}
        for rank, theirs in enumerate(everyone):
            for key, reason in theirs.items():
                out.setdefault(key, reason if key in failures else f"on rank {rank}: {reason}")
        return dict(sorted(out.items(), key=lambda kv: str(kv[0])))

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank reports ``ok``."""
        return all(self.gather(bool(ok)))

    def require_same(self, what: str, value: Any) -> None:
        """Raise on every rank unless all ranks hold the same ``value``.

        Raises:
            ValueError: the ranks differ; the message lists each rank's value.
        """
        everyone = self.gather(value)
        if any(v != everyone[0] for v in everyone[1:]):
            listed = "; ".join(f"rank {r}: {v}" for r, v in enumerate(everyone))
            raise ValueError(f"ranks disagree on {what} ({listed}); every rank must build the same "
                             f"CaptureConfig and request capacity, or their graphs' collectives would not pair up")
