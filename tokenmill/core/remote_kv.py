"""Prefill/decode disaggregation's request states, as the scheduler keeps them (kv_transfer/connector.py moves
the bytes). A consumer admits a request whose prompt KV a producer computed with its blocks reserved, and it
waits for the KV (``waiting``) instead of running; a producer holds a finished request's blocks until the
connector sent them (``sending``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.core.sched_output import KVRecv, KVSend
from tokenmill.request import RequestStatus

if TYPE_CHECKING:
    from tokenmill.core.kv_cache import KVCacheManager
    from tokenmill.request import Request


def wants_remote_prefill(req: Request, num_cached: int) -> bool:
    """Consumer: whether the request's prompt KV is to come from a producer (beyond what is cached)."""
    kv = req.kv_transfer
    return bool(kv and kv.get("do_remote_prefill") and num_cached < req.num_prompt_tokens - 1
                and req.sampling_params.prompt_logprobs is None and not req.output_token_ids)


class RemoteKV:
    def __init__(self, kv_cache: KVCacheManager) -> None:
        self.kv_cache = kv_cache
        self.waiting: dict[str, Request] = {}  # consumer: blocks reserved, KV arriving
        self.sending: set[str] = set()  # producer: finished, blocks held until the connector sent them
        self._sends: list[KVSend] = []  # finished since take_sends
        self._cancelled: set[str] = set()  # aborted while receiving: blocks kept until the pull ends
        self.recompute_failed = True  # a failed pull: compute the prompt here (False: fail the request)
        self._until: dict[str, int] = {}  # waiting: the tokens whose KV it has once its blocks are filled

    # ---- consumer ---------------------------------------------------------------------

    def await_kv(self, req: Request, num_cached: int, num_tokens: int | None = None,
                 block_hashes: list[bytes] = ()) -> KVRecv:
        """The request waits for its prompt's KV (up to ``num_tokens``; all but the last prompt token by default)
        in its reserved blocks: what the connector is to pull (``block_hashes``: read from the KV tier)."""
        kv = self.kv_cache
        first = num_cached // kv.block_size
        n = req.num_prompt_tokens - 1 if num_tokens is None else num_tokens
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.WAITING_FOR_KV
        self.waiting[req.request_id] = req
        self._until[req.request_id] = n
        return KVRecv(req.request_id, kv.block_tables[req.request_id][first:kv.blocks_needed(n)], first, n,
                      req.prompt_token_ids, req.kv_transfer, list(block_hashes))

    def cancel(self, request_id: str) -> None:
        """Aborted while its KV arrives: the connector may be writing its blocks, so they are kept until the
        pull ends (``received``)."""
        del self.waiting[request_id]
        self._until.pop(request_id, None)
        self._cancelled.add(request_id)

    def holds_blocks(self, request_id: str) -> bool:
        """Whether a cancelled pull still holds the request's blocks (not to be freed at its end)."""
        return request_id in self._cancelled

    def received(self, request_id: str, error: str | None) -> Request | None:
        """The connector's pull ended: the request that waited for it (None if it was aborted meanwhile; its
        blocks are freed now). On an error its blocks are freed and it computes from scratch."""
        req = self.waiting.pop(request_id, None)
        if req is None:
            if request_id in self._cancelled:
                self._cancelled.discard(request_id)
                self.kv_cache.free(request_id)
            return None
        until = self._until.pop(request_id, req.num_prompt_tokens - 1)
        if error is None:
            req.kv_transfer = None  # received: preempted later, it recomputes like any request
            req.num_computed_tokens = until
            self.kv_cache.cache_full_blocks(request_id, req.all_token_ids, req.num_computed_tokens)
        else:
            self.kv_cache.free(request_id)
            req.num_computed_tokens = 0
        return req

    # ---- producer ---------------------------------------------------------------------

    def hold_for_send(self, req: Request) -> None:
        """A finished request whose blocks go to a consumer first."""
        self.sending.add(req.request_id)
        self._sends.append(KVSend(req.request_id, list(self.kv_cache.block_tables[req.request_id]),
                                  req.prompt_token_ids))

    def take_sends(self) -> list[KVSend]:
        sends, self._sends = self._sends, []
        return sends

    def sent(self, request_id: str) -> None:
        """The connector sent the blocks (or gave up): they are free."""
        if request_id in self.sending:
            self.sending.discard(request_id)
            self.kv_cache.free(request_id)
