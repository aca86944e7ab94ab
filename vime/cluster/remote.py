"""Remote calls to the run's Ray actors: the one `ray.get` that fails fast and names the actor that died, and
the size of the weight buckets that travel through Ray's object store."""

from __future__ import annotations

import re
from pathlib import Path

import ray

from vime.errors import EngineDiedError, VimeError

BUCKET_BYTES = 64 << 20


def call(refs: list, what: str, names: list[str]) -> list:
    """ray.get of `refs` (results in order) that fails fast, naming the actor that died or raised
    (vime errors and ValueErrors keep their type), even while the others still wait on it."""
    pending, results = dict(zip(refs, names)), {}
    while pending:
        (ref,), _ = ray.wait(list(pending), num_returns=1)
        name = pending.pop(ref)
        try:
            results[ref] = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise EngineDiedError(actor_died_message(name, what, e)) from e
        except ray.exceptions.RayTaskError as e:
            cause = e.cause
            if isinstance(cause, VimeError | ValueError):
                raise type(cause)(f"{name} ({what}): {cause}") from e
            raise EngineDiedError(f"{name} raised during '{what}': {cause.__class__.__name__}: {cause}") from e
    return [results[r] for r in refs]


def actor_died_message(name: str, what: str, error: BaseException) -> str:
    """One line for an actor that died: who, during what, the cause first, the log path last."""
    return f"{name} died during '{what}': {death_cause(str(error))} (its log: {engine_log_hint()})"


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# Where the run's engine output goes (`<output_dir>/engines.log`; None with `verbose=true`: the console).
ENGINE_LOG: list[Path | None] = [None]
_ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Died)\b.*)$")
_WHY = re.compile(r"(killed by [^.]*|exits? with [^.]*|exit detail: [^.]*|OOM[^.]*|out of memory[^.]*)", re.I)


def route_engine_output(path: Path | None) -> None:
    """Record where the run's engine output goes (`path`: engines.log; None: the console, `verbose=true`),
    and send Ray's error notices there too: Ray prints each one on the driver's console as a raw
    `(raylet) ...` line with colour codes, whatever `log_to_driver` says, though vime reports the same
    event in one line of its own (a labelled workaround: the printer Ray's error listener calls is
    replaced)."""
    ENGINE_LOG[0] = path
    if path is None:
        return
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "_vime_print_to_stdstream", ray_worker.print_to_stdstream)

    def printer(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") not in ("raylet", "autoscaler") or ENGINE_LOG[0] is None:
            return original(data, ignore_prefix)
        with open(ENGINE_LOG[0], "a") as f:
            f.writelines(f"({data.get('pid')}) {ANSI.sub('', line)}\n" for line in data.get("lines", []))

    ray_worker._vime_print_to_stdstream = original
    ray_worker.print_to_stdstream = printer


def engine_log_hint() -> str:
    """Where a dead actor's own output is: the run's engines.log, or (verbose) this Ray session's log dir."""
    if ENGINE_LOG[0] is not None:
        return str(ENGINE_LOG[0])
    try:
        import ray

        return ray._private.worker._global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - no Ray node in this process
        return "the Ray session's logs"


def death_cause(text: str, limit: int = 300) -> str:
    """The cause in Ray's report of a dead actor, in one line of at most `limit` characters: the actor's
    own last error (a failed `__init__`: the last exception of the traceback Ray attaches, with the
    indented lines that continue its message), or why its process ended; colour codes and Ray's
    boilerplate removed."""
    lines = [ANSI.sub("", line).rstrip() for line in text.splitlines()]
    last = max(
        (i for i, line in enumerate(lines) if _ERROR_LINE.match(line) and not line.startswith(" ")), default=None
    )
    if last is not None:
        head = _ERROR_LINE.match(lines[last]).group(1)
        name, sep, rest = head.partition(":")
        parts = [f"{name.rsplit('.', 1)[-1]}{sep}{rest}"]
        for line in lines[last + 1 :]:
            if not line.startswith((" ", "\t")) or "For further information visit" in line:
                break
            parts.append(line.strip())
        cause = " ".join(p for p in parts if p)
    else:
        why = _WHY.search(ANSI.sub("", text))
        cause = (
            f"its process ended ({why.group(1).strip()})"
            if why
            else (next((line.strip() for line in lines if line.strip()), "") or "its process ended")
        )
    return cause if len(cause) <= limit else cause[: limit - 3] + "..."
