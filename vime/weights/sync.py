"""Weight sync, trainer -> rollout engines, with version acknowledgement.

The trainer's rank 0 exports HF-named full tensors (TP shards gathered) in buckets and puts them in
Ray's object store itself (the CPU transport here); every engine loads every bucket straight from
the store (the driver only passes the reference, never a copy of the weights), then is told the new
version and reports the version it serves, which the timeline checks.
"""

from __future__ import annotations

import time

from vime.timeline import Timeline


def sync_weights(trainer_ranks: list, engines: list, version: int, bucket_bytes: int, timeline: Timeline,
                 call) -> dict[str, float]:
    """Push the trainer's weights (version `version`) to `engines`; `call(refs, what, names)` is the
    driver's error-reporting ray.get. Returns sync stats."""
    t0 = time.perf_counter()
    exports = call([r.export_to_store.remote(bucket_bytes) for r in trainer_ranks], "export weights",
                   [f"trainer rank {i}" for i in range(len(trainer_ranks))])
    ref, nbytes, nbuckets = exports[0]["buckets"][0], exports[0]["bytes"], exports[0]["count"]
    call([e.load_buckets.remote(ref, version) for e in engines], "load weights",
         [f"rollout engine {i}" for i in range(len(engines))])
    del ref, exports  # the trainer's copy in the store can go
    acks = call([e.set_version.remote(version) for e in engines], "acknowledge weights",
                [f"rollout engine {i}" for i in range(len(engines))])
    for i, v in enumerate(acks):
        timeline.acknowledged(i, v)
    seconds = time.perf_counter() - t0
    return {"sync_s": seconds, "sync_bytes": float(nbytes), "sync_buckets": float(nbuckets),
            "sync_gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0}  # GB (1e9 bytes) of weights per second
