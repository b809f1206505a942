"""The link between training ranks and the generator: a torch.distributed group of their own.

Every message is a list of tensors sent point to point: a fixed-size int64 header (its kind, two
numbers, the tensors' dtypes and shapes) and then each tensor, on one tag per kind of traffic. The
group is separate from Lightning's (its own TCP store), so the training collectives and the rollout
traffic never wait on each other. Gloo on CPU; a GPU run would create the group with NCCL the
same way (not exercised yet).

A request and its answer: ``REQUEST`` (``a`` the iteration, ``b`` :func:`request_number` of the
group size and whether to add greedy answers; the prompt ids and mask, then, in lockstep, the
trainer's random state) and ``SAMPLE_BATCH`` (``a`` the iteration, ``b`` the weight version it was
sampled under; ``input_ids, attention_mask, prompt_lengths, response_ids, response_mask`` and the
behaviour log-probs, then, if asked for, the greedy answers' response ids and lengths, then, in
lockstep, the generator's random state).

Every wait has a deadline. A gloo wait that runs out closes the pair for good, so a timeout here is
final: :class:`LinkLost` says, on one line, which peer and what was awaited.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

#: Tags: trainer -> generator control (requests, weight announcements, stop); trainer ->
#: generator weight buckets; generator -> trainer samples.
CONTROL, WEIGHTS, SAMPLES = 1, 2, 3
#: Message kinds in a header's first slot.
REQUEST, WEIGHT_UPDATE, STOP, SAMPLE_BATCH, READY = 1, 2, 3, 4, 5
#: A REQUEST's ``b`` is its group size, plus this flag when the trainer asks for one greedy answer
#: per row as well (ReMax's baseline): :func:`request_number`, :func:`read_request_number`.
GREEDY_BASELINE = 1 << 32

#: The longest the generator may take to start (spawn, imports, loading its copy of the actor).
STARTUP_S = 600.0
#: How long the generator waits for the trainer's next message: as long as the trainer lives (a dead
#: trainer closes the connection, which ends the wait at once).
IDLE_S = 7 * 24 * 3600.0

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
           torch.bool, torch.int8, torch.int16]
_MAX_TENSORS, _MAX_DIMS = 16, 4
_HEADER = 4 + _MAX_TENSORS * (2 + _MAX_DIMS)


class LinkLost(RuntimeError):
    """The peer died, hung past the timeout, or closed the link."""


def open_group(store: dist.Store, rank: int, world_size: int, timeout_s: float, *, backend: str = "gloo") -> dist.ProcessGroup:
    """This process's end of the rollout group (ranks ``0..world_size-2`` train; the last generates)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore("lightning_mem_rollout", store)
    if backend != "gloo":
        raise ValueError(f"rollout link: only the gloo backend is built so far, got {backend!r}")
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


class Link:
    """Point-to-point messages to and from ``peer`` in ``group``, each wait bounded by ``timeout_s``.

    ``describe_peer`` names the peer in errors (it may read the peer's exit code at that moment).
    """

    def __init__(self, group: dist.ProcessGroup, peer: int, timeout_s: float, describe_peer: Callable[[], str]) -> None:
        self.group, self.peer, self.timeout_s = group, peer, timeout_s
        self.describe_peer = describe_peer

    def _wait(self, work: dist.Work, what: str, timeout_s: float | None = None) -> None:
        try:
            work.wait(datetime.timedelta(seconds=timeout_s or self.timeout_s))
        except RuntimeError as err:
            raise self.lost(what, err, timeout_s) from None

    def lost(self, what: str, err: BaseException, timeout_s: float | None = None) -> LinkLost:
        text = " ".join(str(err).split()) or type(err).__name__  # one line, whatever the backend wrote
        cause = "timed out" if "Timed out" in text or "timeout" in text else "connection lost"
        return LinkLost(f"{self.describe_peer()} failed while {what}: {cause} ({text[:160]}; timeout"
                        f" {timeout_s or self.timeout_s:g}s)")

    def send(self, kind: int, a: int, b: int, tensors: Sequence[Tensor], *, tag: int, what: str) -> None:
        """Send a header and ``tensors``; returns once the peer has them all."""
        self.wait_all(self.isend(kind, a, b, tensors, tag=tag, what=what), what)

    def isend(self, kind: int, a: int, b: int, tensors: Sequence[Tensor], *, tag: int, what: str) -> list[dist.Work]:
        """Start sending; the caller keeps ``tensors`` alive and waits the returned works."""
        header = _header(kind, a, b, tensors)
        try:
            works = [self.group.send([header], self.peer, tag)]
            works += [self.group.send([t.contiguous()], self.peer, tag) for t in tensors]
        except RuntimeError as err:
            raise self.lost(what, err) from None
        works.append(_KeepAlive(header, tensors))
        return works

    def wait_all(self, works: list, what: str) -> None:
        for work in works:
            if not isinstance(work, _KeepAlive):
                self._wait(work, what)

    def recv_header(self, *, tag: int, what: str, timeout_s: float | None = None) -> Tensor:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        try:
            work = self.group.recv([header], self.peer, tag)
        except RuntimeError as err:
            raise self.lost(what, err, timeout_s) from None
        self._wait(work, what, timeout_s)
        return header

    def recv_payload(self, header: Tensor, *, tag: int, what: str) -> list[Tensor]:
        out = []
        for t in receive_buffers(_layout(header)):
            try:
                work = self.group.recv([t], self.peer, tag)
            except RuntimeError as err:
                raise self.lost(what, err) from None
            self._wait(work, what)
            out.append(t)
        return out

    def recv(self, *, tag: int, what: str, timeout_s: float | None = None) -> tuple[int, int, int, list[Tensor]]:
        """The next message on ``tag``; ``timeout_s`` for its header (the link's timeout if None)."""
        header = self.recv_header(tag=tag, what=what, timeout_s=timeout_s)
        kind, a, b = (int(x) for x in header[:3])
        return kind, a, b, self.recv_payload(header, tag=tag, what=what)


def request_number(group_size: int, greedy_baseline: bool) -> int:
    """A REQUEST's ``b``: the group size, flagged with :data:`GREEDY_BASELINE` when asked for."""
    return group_size | (GREEDY_BASELINE if greedy_baseline else 0)


def read_request_number(b: int) -> tuple[int, bool]:
    """A REQUEST's ``b`` as ``(group_size, greedy_baseline)``."""
    return b & (GREEDY_BASELINE - 1), bool(b & GREEDY_BASELINE)


def receive_buffers(layout: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> Iterator[Tensor]:
    """The buffers a message of ``layout`` (dtype and shape per tensor) is received into, one after the
    other: the receiver holds every one of them until the message is used."""
    for dtype, shape in layout:
        yield torch.empty(shape, dtype=dtype)


def layout_of(tensors: Sequence[Tensor]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """What a message's header says of ``tensors``."""
    return _layout(_header(0, 0, 0, tensors))


def names_tensor(names: Iterable[str]) -> Tensor:
    """Names as one message tensor (newline-separated UTF-8 bytes)."""
    return torch.tensor(list("\n".join(names).encode()), dtype=torch.uint8)


def names_of(tensor: Tensor) -> list[str]:
    return bytes(tensor.tolist()).decode().split("\n") if tensor.numel() else []


def json_tensor(value: object) -> Tensor:
    """Plain data (a request's data rows, a multi-turn batch's scores and counts) as one uint8 tensor."""
    import json

    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).clone()


def json_of(tensor: Tensor) -> object:
    import json

    return json.loads(bytes(tensor.tolist()).decode())


class _KeepAlive:
    """Holds a message's buffers until its sends are waited."""

    def __init__(self, *tensors: object) -> None:
        self.tensors = tensors


def _header(kind: int, a: int, b: int, tensors: Sequence[Tensor]) -> Tensor:
    if len(tensors) > _MAX_TENSORS:
        raise ValueError(f"rollout link: at most {_MAX_TENSORS} tensors a message, got {len(tensors)}")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[:4] = torch.tensor([kind, a, b, len(tensors)])
    for i, t in enumerate(tensors):
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"rollout link: at most {_MAX_DIMS} dimensions a tensor, got {tuple(t.shape)}")
        at = 4 + i * (2 + _MAX_DIMS)
        header[at] = _DTYPES.index(t.dtype)
        header[at + 1] = t.dim()
        header[at + 2: at + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header


def _layout(header: Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    out = []
    for i in range(int(header[3])):
        at = 4 + i * (2 + _MAX_DIMS)
        ndim = int(header[at + 1])
        out.append((_DTYPES[int(header[at])], tuple(int(x) for x in header[at + 2: at + 2 + ndim])))
    return out
