"""The KV connector: a producer's finished prefills are pulled, block by block, into a consumer's cache.

One interface, two sides. The producer (``offer``) keeps a finished request's blocks and serves pulls on a
listening socket (loopback unless ``--kv-host`` says otherwise); the consumer (``start_receive``) pulls a
request's blocks from the producer its router named, on a worker thread, and writes them into the blocks
its scheduler reserved. The engine thread collects what ended with ``poll`` (the scheduler then frees the
producer's blocks, or runs the consumer's request); the connector never touches the block bookkeeping.

The pull: the consumer sends {op: pull, request_id, first_block, num_tokens, prompt_hash, layout}; the
producer checks that it holds that request, for the same prompt, in the same KV layout, and answers
{ok, tensors, nbytes} and the payload: every layer's K and V (and int8/fp8 scales) of the asked blocks,
as one flat byte buffer; the consumer acknowledges {op: done}, and only then does the producer let the
blocks go. Transports of the payload: ``tcp`` (the bytes follow on the same stream) or ``torch``
(torch.distributed point to point on a two-rank gloo group per connection, made on the producer's
TCPStore; the payload is staged in host memory, so on GPUs too: an NCCL pair is not built yet); the
control frames are TCP either way.

Failures leak nothing: a dead or silent consumer (the connection breaks, ``--kv-transfer-timeout`` passes
with nobody pulling) releases the producer's blocks; a dead producer or a refused pull ends the receive
with an error, and the consumer's scheduler computes the prompt itself or fails the request.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import logging
import socket
import threading
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.config import KVTransferConfig
from tokenmill.core.kv_cache import cdiv
from tokenmill.core.sched_output import KVRecv, KVSend, KVTransferStats
from tokenmill.kv_transfer.frames import PeerClosed, recv_exactly, recv_header, send_header

if TYPE_CHECKING:
    from torch.distributed import ProcessGroupGloo, Store

logger = logging.getLogger("tokenmill")
RECEIVE_THREADS = 4  # pulls in flight at once on a consumer


class KVTransferError(RuntimeError):
    """A pull the producer refused or could not complete."""


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()


@dataclass
class _Offer:
    block_ids: list[int]
    prompt_hash: str
    num_prompt_tokens: int
    deadline: float
    busy: bool = False


class _Staging:
    """A host byte buffer that grows to the largest transfer and is reused (one per connection)."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
        return self.buf[:nbytes]


@dataclass
class _Channel:
    """A consumer's connection to one producer (pulls on it take turns)."""

    sock: socket.socket
    group: object = None  # the torch transport's two-rank process group
    store: object = None
    lock: threading.Lock = None
    staging: _Staging = None


class KVConnector:
    def __init__(self, config: KVTransferConfig, kv_caches, block_size: int, layout: str) -> None:
        self.config = config
        self.role = config.kv_role
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.layout = layout  # model, dtypes, block size, shapes: both sides must agree
        self.timeout = config.kv_transfer_timeout
        self.wakeup = threading.Event()  # set when a transfer ends
        self._lock = threading.Lock()
        self._events: list[tuple[str, str, str | None, KVTransferStats]] = []
        self._offers: dict[str, _Offer] = {}
        self._receiving = 0
        self._closed = False
        self._tags = itertools.count(1)
        self.address: tuple[str, int] | None = None
        if self.role == "producer":
            self._server = socket.create_server((config.kv_host, config.kv_port))
            self.address = (config.kv_host, self._server.getsockname()[1])
            self._store = None
            if config.kv_transport == "torch":
                import torch.distributed as dist

                self._store = dist.TCPStore(config.kv_host, 0, is_master=True, wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=self.timeout))
            self._pairs = itertools.count()
            self._conns: set[socket.socket] = set()  # consumers' connections, closed at shutdown
            threading.Thread(target=self._accept, name="kv-producer", daemon=True).start()
            logger.info("KV transfer: producer, pulls served on %s:%d (%s)", *self.address, config.kv_transport)
        else:
            self._pool = ThreadPoolExecutor(RECEIVE_THREADS, thread_name_prefix="kv-recv")
            self._channels: dict[tuple[str, int], _Channel] = {}
            logger.info("KV transfer: consumer (%s); a failed pull %s", config.kv_transport,
                        "is computed here" if config.kv_load_failure_policy == "recompute" else "fails its request")

    # ---- the engine thread ---------------------------------------------------------------

    def offer(self, send: KVSend) -> None:
        """Producer: hold a finished request's blocks for a consumer to pull."""
        with self._lock:
            self._offers[send.request_id] = _Offer(send.block_ids, prompt_hash(send.prompt_token_ids),
                                                   len(send.prompt_token_ids), time.monotonic() + self.timeout)

    def start_receive(self, recv: KVRecv) -> None:
        """Consumer: pull a request's KV into its reserved blocks (the end comes back through ``poll``)."""
        with self._lock:
            self._receiving += 1
        self._pool.submit(self._receive, recv)

    def poll(self) -> list[tuple[str, str, str | None, KVTransferStats]]:
        """Transfers that ended since the last call: (kind "sent" | "received", request id, error or None,
        record). Offers nobody pulled within the timeout end here, as failed sends."""
        now = time.monotonic()
        with self._lock:
            for rid, offer in list(self._offers.items()):
                if not offer.busy and now > offer.deadline:
                    del self._offers[rid]
                    why = f"no consumer pulled it within {self.timeout:g} s (--kv-transfer-timeout)"
                    self._events.append(("sent", rid, why, KVTransferStats("send", rid, error=why)))
            events, self._events = self._events, []
            self.wakeup.clear()
        return events

    def pending(self) -> bool:
        """Blocks held for a consumer, or pulls in flight: the engine loop keeps polling."""
        with self._lock:
            return bool(self._offers or self._receiving or self._events)

    def wait(self, timeout: float) -> None:
        self.wakeup.wait(timeout)

    def num_held(self) -> int:
        with self._lock:
            return len(self._offers)

    def shutdown(self) -> None:
        self._closed = True
        if self.role == "producer":
            with self._lock:
                socks = [self._server, *self._conns]
            for sock in socks:  # shutdown() first: it wakes a thread blocked in accept() or recv()
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
        else:
            self._pool.shutdown(wait=False, cancel_futures=True)
            for ch in list(self._channels.values()):
                if ch.sock is not None:
                    ch.sock.close()

    # ---- the payload ---------------------------------------------------------------------

    def _gather(self, block_ids: list[int], staging: _Staging) -> tuple[torch.Tensor, list]:
        """The blocks of every layer's tensors, one after another in one flat host buffer (reused: a fresh
        one would page-fault its way through tens of MB on every transfer)."""
        tensors = [t for layer in self.kv_caches for t in layer]
        sizes = [t[0].numel() * t.element_size() * len(block_ids) for t in tensors]
        flat = staging.get(sum(sizes))
        idx = torch.tensor(block_ids, dtype=torch.long, device=tensors[0].device)
        specs, offset = [], 0
        for t, n in zip(tensors, sizes):
            shape = [len(block_ids), *t.shape[1:]]
            specs.append([str(t.dtype).removeprefix("torch."), shape])
            out = flat[offset:offset + n].view(t.dtype).view(shape)
            if t.device.type == "cpu":
                torch.index_select(t, 0, idx, out=out)  # straight into the buffer: one copy
            else:
                out.copy_(t.index_select(0, idx))
            offset += n
        return flat, specs

    def _scatter(self, block_ids: list[int], flat: torch.Tensor, specs: list) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0][0].device)
        tensors = [t for layer in self.kv_caches for t in layer]
        if len(specs) != len(tensors):
            raise KVTransferError(f"the producer sent {len(specs)} KV tensors, this cache has {len(tensors)}")
        offset = 0
        for t, (dtype, shape) in zip(tensors, specs):
            if dtype != str(t.dtype).removeprefix("torch.") or list(shape) != [len(block_ids), *t.shape[1:]]:
                raise KVTransferError(f"the producer sent a {dtype} {shape} KV tensor where this cache holds "
                                      f"{t.dtype} {[len(block_ids), *t.shape[1:]]}")
            n = t[0].numel() * t.element_size() * len(block_ids)
            part = flat[offset:offset + n].view(t.dtype).view(shape)
            t.index_copy_(0, idx, part.to(t.device))
            offset += n

    # ---- the producer's side -------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name="kv-send", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        group, staging = None, _Staging()
        with sock:
            sock.settimeout(self.timeout)
            try:
                while True:
                    try:
                        msg = recv_header(sock)
                    except (PeerClosed, socket.timeout):
                        return
                    if msg.get("op") == "hello":
                        group = self._hello(sock, msg)
                    elif msg.get("op") == "pull":
                        self._send(sock, msg, group, staging)
                    else:
                        send_header(sock, {"ok": False, "error": f"unknown operation {msg.get('op')!r}"})
            except (OSError, ConnectionError, RuntimeError) as e:
                if not self._closed:
                    logger.warning("KV transfer: a consumer's connection ended: %s", e)
            finally:
                with self._lock:
                    self._conns.discard(sock)

    def _hello(self, sock: socket.socket, msg: dict) -> ProcessGroupGloo | None:
        if msg.get("transport") != self.config.kv_transport:
            send_header(sock, {"ok": False, "error": f"this producer sends KV over {self.config.kv_transport!r}, "
                               f"the consumer asked for {msg.get('transport')!r}: start both with the same "
                               "--kv-transport"})
            return None
        if self._store is None:
            send_header(sock, {"ok": True})
            return None
        pair = next(self._pairs)
        send_header(sock, {"ok": True, "store_port": self._store.port, "pair": pair})
        return _pair_group(self._store, pair, 0, self.timeout)

    def _send(self, sock: socket.socket, msg: dict, group: ProcessGroupGloo | None, staging: _Staging) -> None:
        rid = str(msg.get("request_id"))
        with self._lock:
            offer = self._offers.get(rid)
            error = _refusal(offer, msg, self.layout, rid)
            if error is None:
                offer.busy = True
        if error is not None:
            send_header(sock, {"ok": False, "error": error})
            return
        t0 = time.perf_counter()
        first, num_tokens = int(msg["first_block"]), int(msg["num_tokens"])
        blocks = offer.block_ids[first:cdiv(num_tokens, self.block_size)]
        nbytes, error = 0, None
        try:
            flat, specs = self._gather(blocks, staging)
            nbytes = flat.numel()
            send_header(sock, {"ok": True, "tensors": specs, "nbytes": nbytes, "num_blocks": len(blocks)})
            if group is not None:
                group.send([flat], 1, 0).wait()
            else:
                sock.sendall(memoryview(flat.numpy()))
            ack = recv_header(sock)
            if ack.get("op") != "done":
                error = f"the consumer did not take the KV: {ack.get('error', ack)}"
        except (OSError, ConnectionError, RuntimeError) as e:
            error = f"the consumer went away mid-transfer ({type(e).__name__}: {e})"
            raise
        finally:
            with self._lock:
                self._offers.pop(rid, None)  # sent or not, the blocks are released
                self._events.append(("sent", rid, error, KVTransferStats(
                    "send", rid, len(blocks), nbytes if error is None else 0, time.perf_counter() - t0, error)))
                self.wakeup.set()

    # ---- the consumer's side -------------------------------------------------------------

    def _channel(self, host: str, port: int) -> _Channel:
        key = (host, port)
        with self._lock:
            ch = self._channels.get(key)
            if ch is None:
                ch = self._channels[key] = _Channel(None, lock=threading.Lock(), staging=_Staging())
        return ch

    def _connect(self, ch: _Channel, host: str, port: int) -> None:
        sock = socket.create_connection((host, port), timeout=self.timeout)
        try:
            send_header(sock, {"op": "hello", "transport": self.config.kv_transport})
            reply = recv_header(sock)
            if not reply.get("ok"):
                raise KVTransferError(reply.get("error", "the producer refused the connection"))
            if self.config.kv_transport == "torch":
                import torch.distributed as dist

                ch.store = dist.TCPStore(host, int(reply["store_port"]), is_master=False,
                                         timeout=datetime.timedelta(seconds=self.timeout))
                ch.group = _pair_group(ch.store, int(reply["pair"]), 1, self.timeout)
        except BaseException:
            sock.close()
            raise
        ch.sock = sock

    def _receive(self, r: KVRecv) -> None:
        t0 = time.perf_counter()
        nbytes, error = 0, None
        try:
            remote = r.remote
            try:
                host, port, remote_id = str(remote["remote_host"]), int(remote["remote_port"]), \
                    str(remote["remote_request_id"])
            except (KeyError, TypeError, ValueError):
                raise KVTransferError("kv_transfer_params must give remote_host, remote_port and "
                                      "remote_request_id (as the producer's response has them)") from None
            ch = self._channel(host, port)
            with ch.lock:
                try:
                    if ch.sock is None:
                        self._connect(ch, host, port)
                    nbytes = self._pull(ch, r, remote_id)
                except _Refused:
                    raise  # the producer said no: the connection itself is fine
                except (OSError, ConnectionError, RuntimeError) as e:
                    if ch.sock is not None:  # a broken channel is made again by the next pull
                        ch.sock.close()
                    ch.sock = ch.group = ch.store = None
                    if isinstance(e, KVTransferError):
                        raise
                    raise KVTransferError(f"the producer at {host}:{port} failed: {type(e).__name__}: {e}") from e
        except Exception as e:  # noqa: BLE001 - every failure ends this receive, none the engine
            error = str(e) if isinstance(e, KVTransferError) else f"{type(e).__name__}: {e}"
        with self._lock:
            self._receiving -= 1
            self._events.append(("received", r.request_id, error, KVTransferStats(
                "recv", r.request_id, len(r.block_ids) if error is None else 0, nbytes, time.perf_counter() - t0,
                error)))
            self.wakeup.set()

    def _pull(self, ch: _Channel, r: KVRecv, remote_id: str) -> int:
        send_header(ch.sock, {"op": "pull", "request_id": remote_id, "first_block": r.first_block,
                              "num_tokens": r.num_tokens, "prompt_hash": prompt_hash(r.prompt_token_ids),
                              "layout": self.layout})
        head = recv_header(ch.sock)
        if not head.get("ok"):
            raise _Refused(head.get("error", "the producer refused the pull"))
        if head["num_blocks"] != len(r.block_ids):
            raise KVTransferError(f"the producer sent {head['num_blocks']} blocks, {len(r.block_ids)} were asked for")
        flat = ch.staging.get(int(head["nbytes"]))
        if ch.group is not None:
            ch.group.recv([flat], 0, 0).wait()
        else:
            recv_exactly(ch.sock, flat.numel(), memoryview(flat.numpy()))
        try:
            self._scatter(r.block_ids, flat, head["tensors"])
        except KVTransferError as e:
            send_header(ch.sock, {"op": "failed", "error": str(e)})
            raise _Refused(str(e)) from None
        send_header(ch.sock, {"op": "done"})
        return flat.numel()


class _Refused(KVTransferError):
    """The producer said no (the channel itself is fine)."""


def _refusal(offer: _Offer | None, msg: dict, layout: str, rid: str) -> str | None:
    if offer is None:
        return (f"this producer holds no KV for request {rid!r}: it was never prefilled here, was already "
                "sent, or waited past --kv-transfer-timeout")
    if offer.busy:
        return f"the KV of request {rid!r} is being sent to another consumer"
    if msg.get("layout") != layout:
        return (f"the producer's KV layout {layout!r} differs from the consumer's {msg.get('layout')!r}: serve both "
                "with the same model, --dtype, --quantization, --kv-cache-dtype and --block-size")
    if msg.get("prompt_hash") != offer.prompt_hash:
        return f"request {rid!r} was prefilled here for a different prompt (the tokens differ)"
    n = msg.get("num_tokens")
    if not isinstance(n, int) or not 0 < n < offer.num_prompt_tokens + 1:
        return f"num_tokens {n!r} is outside request {rid!r}'s prompt of {offer.num_prompt_tokens} tokens"
    return None


def _pair_group(store: Store, pair: int, rank: int, timeout: float) -> ProcessGroupGloo:
    """The two-rank group of one producer-consumer connection (rank 0: the producer)."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore(f"kv/{pair}/", store), rank, 2,
                                 datetime.timedelta(seconds=timeout))
