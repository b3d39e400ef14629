"""How many KV pages a cache gets: every request at its longest length, or what fits beside the weights.

A long-context run can want more KV than the GPU holds: 8 requests of 128K at ``rank-of-8``
in bf16 want about 44 GiB of main K/V and index-K, and 99.6 GiB of bf16 weights leave about
40 GiB of an H200. Allocating the wanted pages would fail; the cache gets what fits instead,
and since the scheduler claims a request's whole length at admission, fewer requests run at
once. ``KVBudget.describe`` says so before the run, and the run measures it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.paged import KVCacheConfig


def page_bytes(config: KVCacheConfig) -> int:
    """Bytes of one page across every layer: main K and V, and index-K on the sparse layers
    (``page_size`` positions of ``KVCacheConfig.bytes_per_token``)."""
    return config.page_size * config.bytes_per_token


@dataclass(frozen=True)
class KVBudget:
    """The pages a cache gets and why.

    Attributes:
        page_bytes: one page over every layer (``page_bytes``).
        page_size: positions per page.
        pages_per_request: pages of the longest request (``max_seq_len`` positions).
        wanted: ``max_seqs`` requests at the longest length.
        pages: what the cache gets (``min(wanted, what fits)``).
        free_bytes: device memory free before the build (``None``: not sized, e.g. on a CPU).
        reserved_bytes: of that, kept for the weights and the headroom (activations, graph
            pool, workspaces, allocator slack).
    """

    page_bytes: int
    page_size: int
    pages_per_request: int
    wanted: int
    pages: int
    free_bytes: int | None = None
    reserved_bytes: int = 0

    @property
    def tokens(self) -> int:
        """Positions the cache holds."""
        return self.pages * self.page_size

    @property
    def longest_requests(self) -> int:
        """Requests of the longest length that fit at once."""
        return self.pages // self.pages_per_request

    @property
    def fits(self) -> bool:
        return self.pages >= self.wanted

    def describe(self, label: str) -> str:
        gib = 2**30
        head = (f"{label} KV: {self.pages} pages of {self.page_bytes / 2**20:.2f} MiB = {self.tokens:,} tokens, "
                f"{self.pages * self.page_bytes / gib:.1f} GiB")
        if self.free_bytes is not None:
            head += (f" (of {self.free_bytes / gib:.1f} GiB free, {self.reserved_bytes / gib:.1f} GiB kept for weights "
                     f"and headroom)")
        want, longest = self.wanted // self.pages_per_request, self.pages_per_request * self.page_size
        if self.fits:
            return f"{head}: all {want} requests of {longest:,} positions fit"
        return (f"{head}: does NOT fit {want} requests of {longest:,} positions ({self.wanted} pages): "
                f"{self.longest_requests} fit at once, so fewer are admitted when the prompts are long")


def kv_budget(config: KVCacheConfig, max_seqs: int, max_seq_len: int, *, free_bytes: int | None = None,
              reserved_bytes: int = 0, extra_pages: int = 0) -> KVBudget:
    """The pages for ``max_seqs`` requests of ``max_seq_len`` positions, in the layout of
    ``config`` (its dtypes and dims; its ``num_pages`` is ignored), capped by what fits in
    ``free_bytes - reserved_bytes`` when ``free_bytes`` is given. ``extra_pages``: pages the
    cache allocates beside them (the capture reserve, the padding sink page).

    Raises:
        ValueError: not one request of ``max_seq_len`` positions fits.
    """
    per_page = page_bytes(config)
    per_request = -(-max_seq_len // config.page_size)
    wanted = max_seqs * per_request
    pages = wanted
    if free_bytes is not None:
        pages = min(wanted, max(0, (free_bytes - reserved_bytes) // per_page - extra_pages))
        if pages < per_request:
            raise ValueError(
                f"the KV cache fits {pages} pages of {per_page / 2**20:.2f} MiB in {free_bytes / 2**30:.1f} GiB free "
                f"less {reserved_bytes / 2**30:.1f} GiB for weights and headroom; one request of {max_seq_len} "
                f"positions needs {per_request}: shorten the requests, use an fp8 KV cache, fewer layers, or less "
                f"headroom")
    return KVBudget(per_page, config.page_size, per_request, wanted, pages, free_bytes, reserved_bytes)


__all__ = ["KVBudget", "kv_budget", "page_bytes"]
