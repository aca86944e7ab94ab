"""Weight push, trainer -> rl_kernel's GPU rollout engine, over CUDA IPC (colocated) or NCCL (separate GPUs).

The protocol mirrors vLLM's `ipc` and `nccl` weight-transfer engines (`vllm.distributed.weight_transfer`,
packed mode), which cannot be imported where this runs (no vLLM on the GPU image):

- Tensors are HF-named full tensors (TP shards gathered by the trainer), described per update by
  `names`, `dtype_names`, `shapes` and, per packed bucket, `tensor_sizes` (bytes in the bucket's uint8
  buffer, each padded to `ALIGN` so every view is aligned).
- IPC: the sender packs a bucket into a uint8 CUDA buffer and ships `ipc_handle` = {gpu uuid: the args of
  `torch.multiprocessing.reductions.reduce_tensor`}; the receiver rebuilds the buffer with
  `rebuild_cuda_tensor` on its own device index (zero-copy) and loads views of it.
- NCCL: the sender broadcasts each packed bucket from its rank in a process group shared with the
  receiver; the receiver allocates the bucket from `tensor_sizes` and joins the broadcast.
- Control messages (`start`, `bucket`, `finish`) are plain dicts carried by whatever the caller uses
  (vLLM: its client RPC; vime: Ray actor calls; tests: torch.distributed object send over gloo).
- `start` names every tensor of the push (names, dtypes, shapes): the receiver checks the whole set
  before any data moves, so a caller whose data plane is a collective (NCCL) waits for the answer to
  `start` and never leaves a broadcast that the engine will not join.

Versions (rl_kernel's addition): every message carries the integer weight version being pushed; the
receiver accepts a `start` only for a version greater than the one it serves, a bucket or `finish` only
for the started version, and `finish` answers with an acknowledgement {version, tensors, bytes} that the
sender checks (`check_ack`). Any mismatch raises `WeightVersionError`: never a silent stale engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import torch

ALIGN = 256  # bytes; tensor starts inside a packed bucket are multiples of this
DEFAULT_BUCKET_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES


class WeightVersionError(RuntimeError):
    """A weight push whose versions do not line up (stale, repeated, interleaved or unacknowledged)."""


def dtype_of(dtype: torch.dtype | str) -> torch.dtype:
    """The torch dtype of `dtype`, a torch dtype or its name ('bfloat16' or 'torch.bfloat16')."""
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype name {dtype!r}; use a torch dtype name such as 'bfloat16'")
    return found


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype_name: str  # torch dtype without the "torch." prefix, as vLLM's `dtype_names`
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        try:
            return dtype_of(self.dtype_name)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorMeta:
        return cls(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """Consecutive runs of tensor indices, in order, each run's padded bytes <= bucket_bytes (a tensor
    larger than a bucket gets a bucket of its own). Every tensor lands in exactly one bucket."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    names = [m.name for m in metas]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in a weight push")
    buckets: list[list[int]] = []
    size = 0
    for i, m in enumerate(metas):
        n = padded(m.nbytes)
        if not buckets or size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets


def pack(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """Copy tensors (any dtypes, same device) into one uint8 buffer at ALIGN-padded offsets (a bit copy).
    Returns (buffer, padded sizes)."""
    sizes = [padded(t.numel() * t.element_size()) for t in tensors]
    total = sum(sizes)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    elif out.numel() < total or out.dtype != torch.uint8:
        raise ValueError(f"pack buffer holds {out.numel()} bytes of {out.dtype}; need {total} uint8")
    for t, view in zip(tensors, out[:total].split(sizes)):
        n = t.numel() * t.element_size()
        view[:n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return out[:total], sizes


def unpack(buffer: torch.Tensor, metas: list[TensorMeta], sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    """Views of `buffer` as the named tensors `pack` wrote (no copy)."""
    if len(sizes) != len(metas) or sum(sizes) > buffer.numel():
        raise ValueError(f"bucket of {buffer.numel()} bytes cannot hold {len(metas)} tensors of sizes {sizes}")
    out = []
    for m, view, n in zip(metas, buffer[: sum(sizes)].split(sizes), sizes):
        if padded(m.nbytes) != n:
            raise ValueError(f"{m.name}: {m.nbytes} bytes do not fit its slot of {n}")
        out.append((m.name, view[: m.nbytes].view(m.dtype).view(m.shape)))
    return out


def _bucket_message(version: int, index: int, metas: list[TensorMeta], sizes: list[int], **extra) -> dict:
    return {
        "op": "bucket",
        "version": version,
        "bucket": index,
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype_name for m in metas],
        "shapes": [list(m.shape) for m in metas],
        "tensor_sizes": sizes,
        **extra,
    }


def metas_of(msg: dict) -> list[TensorMeta]:
    """The tensors a push message (`start`, `bucket`, or vLLM's update info) names: one TensorMeta per entry of
    its `names`, `dtype_names` and `shapes` (and `tensor_sizes` when present), in order."""
    n = len(msg["names"])
    if not (len(msg["dtype_names"]) == len(msg["shapes"]) == len(msg.get("tensor_sizes", msg["names"])) == n):
        raise ValueError("`names`, `dtype_names`, `shapes` and `tensor_sizes` must have one entry per tensor")
    return [TensorMeta(a, b, tuple(c)) for a, b, c in zip(msg["names"], msg["dtype_names"], msg["shapes"])]


def check_ack(ack: dict, version: int, tensors: int, nbytes: int) -> None:
    """The sender's check of the receiver's acknowledgement of push `version`."""
    if ack.get("version") != version:
        raise WeightVersionError(f"engine acknowledged weight version {ack.get('version')!r}, pushed {version}")
    if ack.get("tensors") != tensors or ack.get("bytes") != nbytes:
        raise WeightVersionError(
            f"engine acknowledged {ack.get('tensors')} tensors / {ack.get('bytes')} bytes of "
            f"version {version}; sent {tensors} / {nbytes}"
        )


# ---- the NCCL transport's process group ------------------------------------------------------------------


def broadcast(buf: torch.Tensor, group, src: int) -> None:
    """Broadcast `buf` from rank `src` of `group` (its rank in the group, not a global rank): `group` is
    a `torch.distributed` group or a stand-alone backend from `open_weight_group`."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    group.broadcast([buf], opts).wait()


def weight_store(host: str, world: int, port: int | None = None, *, timeout_s: float = 300.0):
    """The rendezvous store of `open_weight_group`: with `port` None, hosted here (rank 0) on a free port
    of `host`, which its `.port` gives to the engines; else a client of the store at `host:port`."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(
        host,
        port or 0,
        world,
        is_master=port is None,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def open_weight_group(store, rank: int, world: int, device: torch.device, *, timeout_s: float = 300.0):
    """The NCCL transport's group over `store` (`weight_store`), apart from any default `torch.distributed`
    world of the process (a Megatron trainer has its own): rank 0 is the trainer's sender, ranks
    1..world-1 the engines. NCCL on CUDA; gloo on CPU (the same protocol, testable without a GPU). Every
    rank must call this concurrently; it returns once all have joined (one 1-element broadcast)."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore("rl_kernel_weights", store)
    if torch.device(device).type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = ProcessGroupNCCL(prefixed, rank, world, options)
    else:
        from torch.distributed import ProcessGroupGloo

        group = ProcessGroupGloo(prefixed, rank, world, timeout)
    broadcast(torch.zeros(1, device=device), group, 0)
    return group


# ---- sender ----------------------------------------------------------------------------------------------


class WeightSender:
    """Trainer side (the rank that holds the gathered full tensors). `send(msg)` carries a control message
    to the engine; `recv()` returns the engine's reply to `finish`. `transport` is "ipc" or "nccl"; for
    "nccl", `group` is a process group holding this rank (`src`, its rank in `group`) and the engine. For
    "ipc" to engines on several GPUs, every GPU's holder of the tensors runs a sender over its own copy and
    `merge_handles` turns this GPU's {uuid: handle} of a bucket into every GPU's (e.g. an all-gather over
    the trainer's ranks; vLLM's IPC trainer engine does the same)."""

    def __init__(
        self,
        transport: str,
        send: Callable[[dict], None],
        recv: Callable[[], dict],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        group=None,
        src: int = 0,
        merge_handles: Callable[[dict], dict] | None = None,
    ):
        if transport not in ("ipc", "nccl"):
            raise ValueError(f"transport must be 'ipc' or 'nccl', got {transport!r}")
        if transport == "nccl" and group is None:
            raise ValueError("the nccl transport needs the process group shared with the engine")
        self.transport, self._send, self._recv = transport, send, recv
        self.bucket_bytes, self.group, self.src = bucket_bytes, group, src
        self.merge_handles = merge_handles
        self.version: int | None = None

    def push(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        """Push named CUDA tensors as weight version `version`; returns the checked acknowledgement plus
        `bytes` and `buckets`. Buffers of IPC buckets are kept alive until the engine has acknowledged."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise WeightVersionError(f"weight version must be an int, got {version!r}")
        if self.version is not None and version <= self.version:
            raise WeightVersionError(f"weight version {version} pushed after {self.version}: versions must grow")
        items = list(tensors)
        metas = [TensorMeta.of(n, t) for n, t in items]
        self._send(
            {
                "op": "start",
                "version": version,
                "transport": self.transport,
                "names": [m.name for m in metas],
                "dtype_names": [m.dtype_name for m in metas],
                "shapes": [list(m.shape) for m in metas],
            }
        )
        keep: list[torch.Tensor] = []
        nbytes = 0
        plan = plan_buckets(metas, self.bucket_bytes)
        for b, idx in enumerate(plan):
            buf, sizes = pack([items[i][1] for i in idx])
            nbytes += sum(metas[i].nbytes for i in idx)
            keep.append(self._ship(_bucket_message(version, b, [metas[i] for i in idx], sizes), buf))
        self._send({"op": "finish", "version": version, "buckets": len(plan)})
        ack = self._recv()
        check_ack(ack, version, len(items), nbytes)
        del keep
        if self.transport == "ipc" and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # free the shared buckets' memory now the engine has released them
        self.version = version
        return {**ack, "buckets": len(plan)}

    def _ship(self, msg: dict, buf: torch.Tensor) -> torch.Tensor | None:
        """Data plane of one bucket: send `msg` and move `buf`; returns what must outlive the push."""
        if self.transport == "ipc":
            handles = ipc_handles(buf)
            self._send({**msg, "ipc_handle": self.merge_handles(handles) if self.merge_handles else handles})
            return buf
        self._send(msg)
        broadcast(buf, self.group, self.src)
        return None


def ipc_handles(buf: torch.Tensor) -> dict[str, tuple]:
    """{this GPU's uuid: the CUDA IPC handle (torch's `reduce_tensor` args) of `buf`}, once the buffer's writes
    are done (the receiver reads on its own stream)."""
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.current_stream(buf.device).synchronize()
    return {str(torch.cuda.get_device_properties(buf.device).uuid): reduce_tensor(buf)[1]}


# ---- receiver --------------------------------------------------------------------------------------------


class WeightReceiver:
    """Engine side. `load(pairs)` consumes (name, tensor) views of a bucket (it must copy what it keeps:
    the buffer is released after the bucket); `expected` (name -> TensorMeta), when given, is the
    engine's weight set: unknown names or other shapes / dtypes raise before anything is loaded, and
    `finish` of a push that misses some raises. `version` is the weight version served now."""

    def __init__(
        self,
        load: Callable[[Iterator[tuple[str, torch.Tensor]]], None],
        device: torch.device,
        *,
        expected: dict[str, TensorMeta] | None = None,
        version: int = 0,
        group=None,
        src: int = 0,
    ):
        self.load, self.device, self.expected = load, torch.device(device), expected
        self.version, self.group, self.src = version, group, src
        self._pending: int | None = None
        self._seen: set[str] = set()
        self._bytes = 0
        self._buckets = 0

    def handle(self, msg: dict) -> dict | None:
        """Process one control message; returns the acknowledgement after `finish`, else None."""
        op, version = msg.get("op"), msg.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise WeightVersionError(f"{op!r} message without an int weight version: {version!r}")
        if op == "start":
            if self._pending is not None:
                raise WeightVersionError(
                    f"push of version {version} started while version {self._pending} is still being received"
                )
            if version <= self.version:
                raise WeightVersionError(f"weight version {version} offered to an engine serving {self.version}")
            metas = metas_of(msg)
            self._check(metas, set())
            if self.expected is not None and {m.name for m in metas} != set(self.expected):
                missing = sorted(set(self.expected) - {m.name for m in metas})
                raise WeightVersionError(f"version {version} lacks {len(missing)} weights, e.g. {missing[:3]}")
            self._pending, self._seen, self._bytes, self._buckets = version, set(), 0, 0
            return None
        if version != self._pending:
            raise WeightVersionError(f"{op!r} of weight version {version} during the push of {self._pending}")
        if op == "bucket":
            self._bucket(msg)
            return None
        if op == "finish":
            if msg.get("buckets") != self._buckets:
                raise WeightVersionError(
                    f"version {version}: {self._buckets} buckets received, {msg.get('buckets')} sent"
                )
            if self.expected is not None and self._seen != set(self.expected):
                missing = sorted(set(self.expected) - self._seen)
                raise WeightVersionError(f"version {version} lacks {len(missing)} weights, e.g. {missing[:3]}")
            self.version, self._pending = version, None
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return {"version": version, "tensors": len(self._seen), "bytes": self._bytes}
        raise ValueError(f"unknown weight-push message {op!r}")

    def _check(self, metas: list[TensorMeta], seen: set[str]) -> None:
        """Names known to the engine, each once, with the engine's shapes and dtypes (else raise)."""
        for m in metas:
            if m.name in seen:
                raise ValueError(f"{m.name} sent twice in version {self._pending}")
            seen = seen | {m.name}
            want = None if self.expected is None else self.expected.get(m.name)
            if self.expected is not None and want is None:
                raise KeyError(f"the engine has no weight {m.name!r}")
            if want is not None and (want.shape != m.shape or want.dtype_name != m.dtype_name):
                raise ValueError(
                    f"{m.name}: pushed {m.dtype_name}{list(m.shape)}, engine holds {want.dtype_name}{list(want.shape)}"
                )

    def _bucket(self, msg: dict) -> None:
        metas, sizes = metas_of(msg), list(msg["tensor_sizes"])
        self._check(metas, self._seen)
        self._load_bucket(msg, metas, sizes)
        self._seen.update(m.name for m in metas)
        self._bytes += sum(m.nbytes for m in metas)
        self._buckets += 1

    def _load_bucket(self, msg: dict, metas: list[TensorMeta], sizes: list[int]) -> None:
        """Move and load one checked bucket (a subclass may hand it to another engine instead)."""
        buf = self._fetch(msg, sum(sizes))
        self.load(iter(unpack(buf, metas, sizes)))
        del buf

    def _fetch(self, msg: dict, nbytes: int) -> torch.Tensor:
        """Data plane of one bucket: its uint8 buffer (an IPC view, or a fresh tensor NCCL fills)."""
        if "ipc_handle" in msg:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            handles = msg["ipc_handle"]
            if uuid not in handles:
                raise ValueError(f"no IPC handle for GPU {uuid}; handles for {list(handles)}")
            args = list(handles[uuid])
            # the receiver's own index of that GPU (as vLLM's IPC engine)
            args[6] = torch.cuda.current_device() if self.device.index is None else self.device.index
            return rebuild_cuda_tensor(*args)
        if self.group is None:
            raise ValueError("a bucket without an IPC handle needs the NCCL group shared with the trainer")
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        broadcast(buf, self.group, self.src)
        return buf


def expected_weights(config, dtype: torch.dtype | str) -> dict[str, TensorMeta]:
    """What a push into an engine serving a Qwen3 `config` (`rl_kernel.models.qwen3.Qwen3Config`) in
    `dtype` must carry: every full HF-named tensor of the model (the LM head only when untied)."""
    from rl_kernel.models.qwen3_layout import weight_layout

    dtype_name = str(dtype).removeprefix("torch.")
    return {n: TensorMeta(n, dtype_name, w.shape) for n, w in weight_layout(config).items()}


def receiver_for_model(model, *, version: int = 0, group=None, src: int = 0) -> WeightReceiver:
    """A receiver that loads into a `Qwen3Reference` (the GPU rollout engine's model): expects its full
    HF-named weights in the model dtype; each bucket goes through `load_hf_weights` (a copy, sharded)."""
    return WeightReceiver(
        lambda pairs: model.load_hf_weights(dict(pairs)),
        model.device,
        expected=expected_weights(model.config, model.dtype),
        version=version,
        group=group,
        src=src,
    )
