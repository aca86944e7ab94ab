"""A weight push into vLLM engines on CUDA through vLLM's own `nccl` weight-transfer engine: vLLM's rendezvous
(StatelessProcessGroup + PyNccl over a TCPStore that trainer rank 0 hosts) and its packed wire.

Trainer rank 0, which holds the gathered HF-named tensors, drives vLLM's `NCCLTrainerWeightTransferEngine`
(`VllmNCCLSender`) with a `WeightSource` over those tensors (`TensorDictSource`) and a client (`EngineClient`)
that carries vLLM's four client calls to the engines as control messages (dicts; vime sends them as Ray actor
calls). Each engine answers them with a `VllmNCCLReceiver` over its `llm`.

Versions follow `rl_kernel.weights.transfer`: before any NCCL call (the rendezvous included) every
engine checks the push (`start`: a version above the one it serves, exactly its tensors with its shapes and
dtypes); after vLLM's round trip each engine commits the version in vLLM (`finish`: vLLM's engine weight
version, prefix-cache reset) and acknowledges {version, tensors, bytes}, which the sender checks. Any mismatch
raises `WeightVersionError`.

Written against vllm 0.32 (`vllm/distributed/weight_transfer/nccl_engine.py`, `clients.py`, `base.py`) and
tested on CPU with stand-in engines only: no machine here runs NCCL (docs/vllm.md, "CUDA path: written, not
run").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict

import torch

from rl_kernel.integrations.vllm import finish_weight_update
from rl_kernel.integrations.vllm.compat import get_weight_version
from rl_kernel.weights.transfer import (
    TensorMeta,
    WeightReceiver,
    WeightVersionError,
    check_ack,
    dtype_of,
    metas_of,
)
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

try:
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine
except ImportError:  # vLLM 0.26: a trainer side of static functions this push does not drive (compat)
    NCCLTrainerInitInfo = NCCLTrainerWeightTransferEngine = None
from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

Send = Callable[[list[dict]], list]  # msgs[i] to engine i; returns the engines' replies, in order


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    return None if dtype is None else dtype_of(dtype)


class TensorDictSource(WeightSource):
    """vLLM's `WeightSource` over full HF-named tensors held on this rank (name -> tensor), declared and
    yielded in the dict's order as it was at construction. The wire dtype is `dtype` (the engines' dtype;
    None: each tensor's own): a tensor of another dtype is cast as it is yielded, one at a time. Re-iterable:
    each pass yields the same tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype | str | None = None):
        self._items = tuple(tensors.items())
        self.dtype = _dtype(dtype)

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, self.dtype or t.dtype, tuple(t.shape)) for name, t in self._items]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._items:
            yield name, t if self.dtype in (None, t.dtype) else t.to(self.dtype)


def _metas(meta: list[ParamMeta]) -> list[TensorMeta]:
    return [TensorMeta(m.name, str(m.dtype).removeprefix("torch."), tuple(m.shape)) for m in meta]


def update_payload(meta: list[ParamMeta]) -> dict:
    """The update info vLLM's trainer engine sends with `update_weights` for a source of metadata `meta`:
    `NCCLWeightTransferUpdateInfo` as a dict (names, dtype_names, shapes; metadata order)."""
    metas = _metas(meta)
    return asdict(
        NCCLWeightTransferUpdateInfo(
            names=[m.name for m in metas],
            dtype_names=[m.dtype_name for m in metas],
            shapes=[list(m.shape) for m in metas],
        )
    )


def packed_chunks(meta: list[ParamMeta], buffer_bytes: int) -> int:
    """How many packed buffers vLLM's producer broadcasts for `meta` (`packed_tensor.pack_tensors`: a buffer
    takes tensors, in order, until its bytes exceed `buffer_bytes`, the tensor that exceeds them included)."""
    chunks, size, pending = 0, 0, 0
    for m in _metas(meta):
        size, pending = size + m.nbytes, pending + 1
        if size > buffer_bytes:
            chunks, size, pending = chunks + 1, 0, 0
    return chunks + (pending > 0)


class EngineClient:
    """vLLM's `VLLMWeightSyncClient` (the four calls its trainer engine makes) over control messages to the
    engines' `VllmNCCLReceiver`s: `send(msgs)` delivers msgs[i] to engine i and returns their replies.

    Engine i's vLLM workers take `ranks[i]` ranks of the transfer group, after the trainer (rank 0) and the
    engines before it: vLLM's trainer engine gives every worker `rank_offset` 1, which is right for one
    engine only, so this client rewrites it per engine. `version` is the push in progress: every call carries
    it, and the engines' acknowledgements of `finish` are kept in `acks`."""

    def __init__(self, send: Send, ranks: list[int]):
        if not ranks or any(n < 1 for n in ranks):
            raise ValueError(f"every engine must bring at least one vLLM worker to the group, got ranks {ranks}")
        self._send, self.ranks = send, list(ranks)
        self.offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        self.world_size = 1 + sum(ranks)
        self.version: int | None = None
        self.acks: list[dict] = []

    def _all(self, msg: dict) -> list:
        return self._send([msg] * len(self.ranks))

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._send(
            [
                {"op": "init_weight_transfer_engine", "init_info": {**init_info, "rank_offset": offset}}
                for offset in self.offsets
            ]
        )

    def start_weight_update(self) -> None:
        self._all({"op": "start_weight_update", "version": self.version})

    def update_weights(self, update_info: dict) -> None:
        self._all({"op": "update_weights", "version": self.version, "update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is not None and weight_version != str(self.version):
            raise WeightVersionError(f"finish of weight version {weight_version!r} during the push of {self.version}")
        self.acks = self._all({"op": "finish", "version": self.version})


class VllmNCCLSender:
    """Trainer rank 0's push into `engines` vLLM engines (`send`: see `EngineClient`) over vLLM's nccl engine.

    The first push forms the transfer group: the engines report their workers (`ranks`), and vLLM's
    `NCCLTrainerWeightTransferEngine.trainer_init` hosts the rendezvous at `host` on a free port while the
    engines join it. Later pushes reuse it; a sender serves one set of engines (make a new one when they
    change). `dtype` is the engines' dtype (the wire dtype); `buffer_bytes` the size of vLLM's packed
    buffers. `trainer_init` replaces vLLM's (tests without NCCL only)."""

    def __init__(
        self,
        send: Send,
        engines: int,
        host: str,
        *,
        dtype: torch.dtype | str | None = None,
        buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        trainer_init: Callable | None = None,
    ):
        self._send, self.engines, self.host = send, engines, host
        self.dtype, self.buffer_bytes = _dtype(dtype), buffer_bytes
        if trainer_init is None and NCCLTrainerWeightTransferEngine is None:
            raise ValueError(
                "this vLLM's nccl weight-transfer engine has no NCCLTrainerWeightTransferEngine "
                "(vLLM 0.26), which this push drives: use the ipc transport"
            )
        self._trainer_init = trainer_init or NCCLTrainerWeightTransferEngine.trainer_init
        self.client: EngineClient | None = None
        self.engine = None  # vLLM's trainer engine, once the group is formed
        self.version: int | None = None

    def push(self, tensors: dict[str, torch.Tensor], version: int) -> dict:
        """Push `tensors` (on this rank's GPU) as weight version `version`; returns the engines' checked
        acknowledgement {version, tensors, bytes} plus `buckets` (vLLM's packed buffers sent). Raises
        WeightVersionError for a version that does not grow or an acknowledgement that does not match; an
        engine that refuses the push raises from `send` before any NCCL call."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise WeightVersionError(f"weight version must be an int, got {version!r}")
        if self.version is not None and version <= self.version:
            raise WeightVersionError(f"weight version {version} pushed after {self.version}: versions must grow")
        source = TensorDictSource(tensors, self.dtype)
        meta = source.metadata()
        self._send([{"op": "start", "version": version, **update_payload(meta)}] * self.engines)
        engine = self._open(source)
        engine.source = source  # vLLM's engine replays its source each round: this round's tensors
        self.client.version = version
        engine.send_weights()
        metas = _metas(meta)
        for ack in self.client.acks:
            check_ack(ack, version, len(metas), sum(m.nbytes for m in metas))
        self.version = version
        return {**self.client.acks[0], "buckets": packed_chunks(meta, self.buffer_bytes)}

    def _open(self, source: TensorDictSource):
        if self.engine is None:
            from vllm.utils.network_utils import get_open_port

            self.client = EngineClient(self._send, self._send([{"op": "ranks"}] * self.engines))
            info = NCCLTrainerInitInfo(
                master_address=self.host,
                master_port=get_open_port(),
                world_size=self.client.world_size,
                rank=0,
                packed=True,
                packed_buffer_size_bytes=self.buffer_bytes,
            )
            self.engine = self._trainer_init(info, client=self.client, source=source)
        return self.engine


class VllmNCCLReceiver(WeightReceiver):
    """Engine side of a `VllmNCCLSender` push into `llm` (an engine built with `transport="nccl"`).

    Messages: `ranks` -> how many ranks of the group this engine's vLLM workers take; `start` -> the checks
    of `WeightReceiver` (versions grow, the push names exactly `expected` with its shapes and dtypes), no vLLM
    call; `init_weight_transfer_engine`, `start_weight_update`, `update_weights` -> the same call of `llm`
    (vLLM's workers join the rendezvous / receive the broadcast inside it); `finish` -> the update vLLM
    received must be the one checked at `start`, then `finish_weight_update(llm, version)` and vLLM must
    serve `version`; returns the acknowledgement {version, tensors, bytes}. The tensors never pass through
    this process."""

    def __init__(self, llm, expected: dict[str, TensorMeta], *, version: int = 0):
        super().__init__(load=None, device="cpu", expected=expected, version=version)  # type: ignore[arg-type]
        self.llm = llm
        self._offered: list[TensorMeta] = []  # what `start` checked
        self._received: list[TensorMeta] | None = None  # what vLLM was told to receive

    def handle(self, msg: dict) -> dict | int | None:
        op = msg.get("op")
        if op == "ranks":
            return int(self.llm.llm_engine.vllm_config.parallel_config.world_size_across_dp)
        if op == "init_weight_transfer_engine":
            self.llm.init_weight_transfer_engine({"init_info": msg["init_info"]})
            return None
        if op == "start":
            super().handle(msg)
            self._offered, self._received = metas_of(msg), None
            return None
        if msg.get("version") is None or msg.get("version") != self._pending:
            raise WeightVersionError(
                f"{op!r} of weight version {msg.get('version')!r} during the push of {self._pending}"
            )
        if op == "start_weight_update":
            self.llm.start_weight_update()
        elif op == "update_weights":
            self._received = metas_of(msg["update_info"])
            self.llm.update_weights({"update_info": msg["update_info"]})
        elif op == "finish":
            return self._finish(msg["version"])
        else:
            raise ValueError(f"unknown message {op!r} of a vLLM nccl weight push")
        return None

    def _finish(self, version: int) -> dict:
        if self._received != self._offered:
            got = "no update" if self._received is None else f"{len(self._received)} tensors"
            raise WeightVersionError(
                f"version {version}: vLLM was sent {got}, not the {len(self._offered)} tensors checked at start"
            )
        finish_weight_update(self.llm, version)
        served = get_weight_version(self.llm)
        if served != str(version):
            raise WeightVersionError(f"vLLM serves weight version {served!r} after the push of version {version}")
        self.version, self._pending = version, None
        return {"version": version, "tensors": len(self._offered), "bytes": sum(m.nbytes for m in self._offered)}
