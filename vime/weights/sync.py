"""Weight sync, trainer -> rollout engines, with version acknowledgement (`weights.transport`).

- `object_store` (CPU): the trainer's rank 0 exports HF-named full tensors (TP shards gathered) in
  buckets and puts them in Ray's object store itself; every engine loads every bucket straight from the
  store (the driver passes only the reference, never a copy of the weights).
- `ipc` (engines colocated on the trainer's GPUs) and `nccl` (engines on GPUs of their own): rank 0
  pushes the gathered tensors itself (`EnginePush`, rl_kernel.weights.transfer's protocol): CUDA
  IPC handles of packed buckets, or the buckets broadcast in an NCCL group of rank 0 and the engines.
  The control messages go to the engines' Ray actors; the engines acknowledge the version they received.
- `nccl` into vLLM engines (`vllm_nccl`, `push_transport`): rank 0 drives vLLM's own trainer engine
  (`NCCLTrainerWeightTransferEngine`: vLLM's rendezvous and packed wire) through
  rl_kernel.integrations.vllm.nccl; its client calls go to the engines' Ray actors, which check the push
  before any NCCL call and acknowledge the version vLLM serves after it.

Either way each engine is then told the new version and reports the version it serves, which the
timeline checks.
"""

from __future__ import annotations

import time

import torch

from rl_kernel.weights.transfer import DEFAULT_BUCKET_BYTES
from vime.config.schema import RolloutBackend
from vime.errors import WeightSyncError
from vime.loop.timeline import Timeline

VLLM_NCCL = "vllm_nccl"  # `nccl` into vLLM engines: vLLM's own rendezvous and wire


def push_transport(transport: str, rollout_engine: str) -> str:
    """What trainer rank 0 speaks for an engine's weight path (`vime.config.layout.Transport`) into `rollout.engine`'s
    actors: vLLM engines take `nccl` as vLLM's own rendezvous and wire (VLLM_NCCL); `gloo` is rl_kernel's push
    group, which is gloo on CPU (`nccl` to `EnginePush`); every other pair is `transport` itself."""
    vllm = RolloutBackend(rollout_engine) == RolloutBackend.vllm
    if str(transport) == "gloo":
        return "nccl"
    return VLLM_NCCL if vllm and str(transport) == "nccl" else str(transport)


def sync_weights(
    trainer_ranks: list,
    engines: list,
    version: int,
    bucket_bytes: int,
    timeline: Timeline,
    call,
    transport: str | list[str] = "object_store",
    rollout_engine: str | None = None,
) -> dict:
    """Push the trainer's weights (version `version`) to `engines`, each over its weight path: `transport` is
    one path for every engine or a list with one per engine (`object_store`, `ipc`, `nccl`, `gloo`, or
    VLLM_NCCL: see `push_transport`, applied when `rollout_engine` is given). Engines that share a path
    share one export or push (the object store's engines all load the one exported copy; a push goes to the
    engines of its path that do not serve `version` yet). `call(refs, what, names)` is the driver's
    error-reporting ray.get. `bucket_bytes` sizes the object store's buckets; the pushes pack 1 GiB buckets
    (vLLM's packed-buffer size). Returns sync stats (seconds, bytes, GB/s) and `sync_transports`, the path
    each engine was served by."""
    t0 = time.perf_counter()
    paths = [str(transport)] * len(engines) if isinstance(transport, str) else [str(t) for t in transport]
    if len(paths) != len(engines):
        raise ValueError(f"{len(paths)} weight paths for {len(engines)} engines")
    ranks = [f"trainer rank {i}" for i in range(len(trainer_ranks))]
    names = [f"rollout engine {i}" for i in range(len(engines))]
    nbytes = nbuckets = 0
    for path in dict.fromkeys(paths):  # each path once, in the engines' order
        # only the engines that do not serve `version` yet: every engine after a step, all of them at a resume,
        # the one restarted engine after a restart (the one weight path of steps, resume and restart alike)
        idx = [i for i, p in enumerate(paths) if p == path and timeline.engine_versions[i] != version]
        if not idx:
            continue
        if path == "object_store":
            exports = call([r.export_to_store.remote(bucket_bytes) for r in trainer_ranks], "export weights", ranks)
            ref, nbytes, nbuckets = exports[0]["buckets"][0], exports[0]["bytes"], exports[0]["count"]
            call([engines[i].load_buckets.remote(ref, version) for i in idx], "load weights", [names[i] for i in idx])
            del ref, exports  # the trainer's copy in the store can go
            continue
        behind = [engines[i] for i in idx]
        wire = push_transport(path, rollout_engine) if rollout_engine is not None else path
        pushed = call(
            [r.push_weights.remote(behind, version, wire, DEFAULT_BUCKET_BYTES) for r in trainer_ranks],
            "push weights",
            ranks,
        )[0]
        nbytes, nbuckets = max(nbytes, pushed["bytes"]), max(nbuckets, pushed["buckets"])
    acks = call([e.set_version.remote(version) for e in engines], "acknowledge weights", names)
    for i, v in enumerate(acks):
        timeline.acknowledged(i, v)
    seconds = time.perf_counter() - t0
    return {
        "sync_s": seconds,
        "sync_bytes": float(nbytes),
        "sync_buckets": float(nbuckets),
        "sync_gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0,  # GB (1e9 bytes) of weights per second
        "sync_transports": paths,
    }


class GroupReceiver:
    """An engine's side of rl_kernel's push group (`gloo` on CPU) for an engine that loads weights as buckets
    of full HF-named tensors (`update_weights(bucket, version)`: vLLM on CPU, whose own weight-transfer
    engines move CUDA memory). Each bucket broadcast by trainer rank 0 is checked (names, shapes, dtypes,
    growing versions: rl_kernel.weights.transfer.WeightReceiver) and handed to the engine; the driver's
    `set_version` then ends the engine's update session as after an object-store sync.

    With `stage` (in-flight updates, `rollout.partial`; the messages then arrive in the actor's "weights"
    concurrency group, beside a running rollout) the received buckets are copied into a staging buffer in host
    memory instead, and at `finish` handed to `stage(buckets, version)`, which returns once they have landed
    at the next engine-step boundary of the running rollout (or at once when none runs) with the version the
    engine serves; the acknowledgement goes back only then."""

    def __init__(self, engine, model_path: str, dtype: str, stage=None):
        self.engine, self.model_path, self.dtype, self._stage = engine, model_path, dtype, stage
        self._group = self._store = self._receiver = None
        self._version: int | None = None
        self._staging: list[dict[str, torch.Tensor]] = []

    def join(self, host: str, port: int, rank: int, world: int) -> None:
        from rl_kernel.weights.transfer import open_weight_group
        from vime.cluster import placement

        placement.bind_node_interface()
        self._store = placement.tcp_store(host, port, world, timeout_s=300.0)
        self._group = open_weight_group(self._store, rank, world, torch.device("cpu"))

    def handle(self, msg: dict) -> dict | None:
        from rl_kernel.models.qwen3 import read_config
        from rl_kernel.weights.transfer import WeightReceiver, expected_weights

        if self._group is None:
            raise WeightSyncError("a weight push arrived before the engine joined the trainer's push group")
        if msg.get("op") == "start":  # from the version the engine serves now (it may have loaded others since)
            self._receiver = WeightReceiver(
                self._load,
                torch.device("cpu"),
                version=int(self.engine.version),
                expected=expected_weights(read_config(self.model_path), self.dtype),
                group=self._group,
                src=0,
            )
            self._version, self._staging = msg.get("version"), []
        if self._receiver is None:
            raise WeightSyncError(f"weight-push message {msg.get('op')!r} without a start")
        ack = self._receiver.handle(msg)
        if ack is not None and self._stage is not None:
            buckets, self._staging = self._staging, []
            served = self._stage(buckets, self._version)
            if served != self._version:
                raise WeightSyncError(f"weight version {self._version} was staged, the engine serves {served}")
        return ack

    def _load(self, pairs) -> None:
        bucket = {name: t.clone() for name, t in pairs}  # the receive buffer is reused for the next bucket
        if self._stage is not None:
            self._staging.append(bucket)
        else:
            self.engine.update_weights(bucket, self._version)


class EnginePush:
    """Trainer rank 0's side of an `ipc` / `nccl` push into rollout actors (`RolloutWorker.receive_weights`).

    Control messages are Ray calls. `start` is answered before anything moves (the engines check the
    push's names, shapes and version); the rest are submitted without waiting (a caller's calls to one
    actor run in order), so that rank 0 can broadcast a bucket while the engines wait for it, and their
    replies are collected after `finish`. Every engine must acknowledge the same version, tensors and bytes. The
    NCCL group is formed on the first push and again whenever the set of engines changes (a restart).

    VLLM_NCCL (vLLM engines on `nccl`) goes through rl_kernel.integrations.vllm.nccl instead, on rank 0 only:
    the tensors travel in `dtype` (the engines' dtype); vLLM's transfer group is formed and re-formed the same
    way."""

    def __init__(self, device: torch.device, dtype: torch.dtype | str | None = None):
        self.device, self.dtype = torch.device(device), dtype
        self._group = None
        self._vllm = None  # rl_kernel.integrations.vllm.nccl.VllmNCCLSender of the engines in `_members`
        self._members: tuple | None = None

    def push(
        self,
        engines: list,
        tensors: dict[str, torch.Tensor],
        version: int,
        transport: str,
        bucket_bytes: int,
        every_rank: bool = False,
        concurrency_group: str | None = None,
    ) -> dict:
        """`every_rank` (ipc to engines on several trainer GPUs; a collective of the trainer's world): each
        rank packs its own copy of `tensors` on its GPU, rank 0 sends the buckets' handles of every GPU
        (all-gathered), and every rank keeps its buffers until rank 0 has the engines' acknowledgement.
        `concurrency_group` (in-flight updates: "weights"): the engines' concurrency group the control
        messages (and a group join) go to, so that they run beside a rollout; their acknowledgement comes once
        the version has landed in it (`GroupReceiver`)."""
        import ray

        from rl_kernel.weights.transfer import WeightSender, WeightVersionError

        if transport == VLLM_NCCL:
            return self._vllm_push(engines, tensors, version, bucket_bytes)
        group = self._nccl_group(engines, concurrency_group) if transport == "nccl" else None
        lead = not every_rank or torch.distributed.get_rank() == 0
        pending: list[list] = []

        def shared(outcome, what: str):
            """Rank 0's outcome (a value, or the exception it met) on every rank: the other ranks must not
            wait in a collective that rank 0 has left."""
            if every_rank:
                box = [f"{type(outcome).__name__}: {outcome}" if isinstance(outcome, BaseException) else outcome]
                torch.distributed.broadcast_object_list(box, src=0)
                if not lead:
                    outcome = (
                        box[0]
                        if not isinstance(box[0], str)
                        else WeightVersionError(f"trainer rank 0's {what} of weight version {version} failed: {box[0]}")
                    )
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        def send(msg: dict) -> None:
            outcome = None
            if lead:
                pending.append([_method(e, "receive_weights", concurrency_group).remote(msg) for e in engines])
                if msg["op"] == "start":  # the engines check the whole push before any bucket moves
                    try:
                        ray.get(pending[-1])
                    except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
                        outcome = e
            if msg["op"] == "start":
                shared(outcome, "push")

        def recv() -> dict:
            ack: object = None
            if lead:
                try:
                    acks = [ray.get(refs) for refs in pending][-1]
                    ack = (
                        acks[0]
                        if all(a == acks[0] for a in acks)
                        else WeightVersionError(f"engines acknowledged different pushes of version {version}: {acks}")
                    )
                except Exception as e:  # noqa: BLE001 - re-raised by `shared`, after the other ranks know
                    ack = e
            return shared(ack, "acknowledgement")

        sender = WeightSender(
            transport,
            send,
            recv,
            bucket_bytes=bucket_bytes,
            group=group,
            src=0,
            merge_handles=_all_gathered if every_rank else None,
        )
        return sender.push(tensors.items(), version)

    def _vllm_push(self, engines: list, tensors: dict[str, torch.Tensor], version: int, bucket_bytes: int) -> dict:
        from rl_kernel.weights.transfer import WeightVersionError

        try:
            return self._vllm_sender(engines, bucket_bytes).push(tensors, version)
        except (WeightVersionError, WeightSyncError) as e:  # an engine's refusal comes wrapped by Ray: its cause
            raise WeightSyncError(
                f"trainer rank 0: vLLM nccl push of weight version {version}: {getattr(e, 'cause', e)}"
            ) from e

    def _vllm_sender(self, engines: list, bucket_bytes: int):
        import ray

        members = (VLLM_NCCL, *(e._actor_id.hex() for e in engines))
        if members != self._members:
            try:
                from rl_kernel.integrations.vllm.nccl import VllmNCCLSender
            except ImportError as e:
                raise WeightSyncError(
                    f"weights.transport=nccl into vLLM engines runs vLLM's trainer engine on trainer "
                    f"rank 0, where vLLM cannot be imported ({e}); install vllm in the trainer's "
                    "environment or use weights.transport=ipc"
                ) from e

            def send(msgs: list[dict]) -> list:
                return ray.get([e.receive_weights.remote(m) for e, m in zip(engines, msgs)])

            # a former group's communicator is dropped, not destroyed: with a dead member it may not come down
            self._vllm = VllmNCCLSender(
                send, len(engines), ray.util.get_node_ip_address(), dtype=self.dtype, buffer_bytes=bucket_bytes
            )
            self._members = members
        return self._vllm

    def _nccl_group(self, engines: list, concurrency_group: str | None = None):
        import ray

        from rl_kernel.weights.transfer import open_weight_group
        from vime.cluster import placement

        members = tuple(e._actor_id.hex() for e in engines)
        if members != self._members:
            host, world = ray.util.get_node_ip_address(), len(engines) + 1
            listen = placement.listen_socket(host)  # the group's store on this node's address only
            port = listen.getsockname()[1]
            store = placement.tcp_store(host, port, world, listen, timeout_s=300.0)
            placement.bind_node_interface()
            joins = [
                _method(e, "join_weight_group", concurrency_group).remote(host, port, i + 1, world)
                for i, e in enumerate(engines)
            ]
            self._group = open_weight_group(store, 0, world, self.device)
            self._group_store = store  # lives as long as the group
            ray.get(joins)
            self._members = members
        return self._group


def _method(actor, name: str, concurrency_group: str | None):
    """`actor.name`, in `concurrency_group` when one is given (Ray's default group otherwise)."""
    method = getattr(actor, name)
    return method.options(concurrency_group=concurrency_group) if concurrency_group else method


def _all_gathered(handles: dict) -> dict:
    """{uuid: handle} of this trainer rank's GPU -> every rank's (all-gather over the trainer's world)."""
    parts: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, handles)
    return {uuid: h for part in parts for uuid, h in part.items()}
