"""The one restart-and-retry loop (`vime.faults.restart.each_engine`: a step's rollout in either loop, the sleep
and wake-up of a colocated run), as pure logic: the engines are stand-in names, a call is its (actor, argument)
pair and "dies" when its actor is in a dead set. The restart itself is tested against real actors in
tests/vime/test_weight_push.py and tests/vime/test_resume.py (extended)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray

from vime.errors import EngineDiedError
from vime.faults import restart


def _stand_ins(monkeypatch, engines: list[str], dead: set[str], replaces: dict[int, list[int]]):
    """A driver over `engines`; a call to an actor in `dead` dies as a killed actor's does; restarting engine i
    replaces engines `replaces[i]` (default: i alone; more: the reload's push found those dead too)."""
    driver = SimpleNamespace(engines=list(engines))
    restarts, submitted = [], []

    def call(refs, what, names):
        actor, arg = refs[0]
        if actor in dead:
            raise EngineDiedError(f"{names[0]} died during '{what}'") from ray.exceptions.RayActorError()
        return [f"{actor}:{arg}"]

    def restarted(d, i, cause, who, reload=True):
        restarts.append((i, reload))
        for j in replaces.get(i, [i]):
            d.engines[j] += "'"

    def submit(i):
        submitted.append(driver.engines[i])
        return driver.engines[i], i

    monkeypatch.setattr("vime.cluster.remote.call", call)
    monkeypatch.setattr(restart, "restart_engine", restarted)
    return driver, submit, restarts, submitted


def test_a_dead_engine_is_restarted_and_its_call_made_again_on_the_fresh_actor(monkeypatch):
    driver, submit, restarts, submitted = _stand_ins(monkeypatch, ["a", "b"], {"b"}, {})
    assert restart.each_engine(driver, submit, "sleep", reload=False) == ["a:0", "b':1"]
    assert restarts == [(1, False)] and submitted == ["a", "b", "b'"]


def test_a_call_whose_actor_another_restart_replaced_is_made_again_without_a_second_restart(monkeypatch):
    # engine 0 dies; its restart's reload finds engine 1 dead and restarts it too: engine 1's first call (to
    # the dead actor) is made again on its fresh actor, and the run counts two restarts' worth, not three
    driver, submit, restarts, submitted = _stand_ins(monkeypatch, ["a", "b"], {"a", "b"}, {0: [0, 1]})
    assert restart.each_engine(driver, submit, "generate") == ["a':0", "b':1"]
    assert restarts == [(0, True)] and submitted == ["a", "b", "a'", "b'"]


def test_results_already_in_are_kept_and_calls_already_issued_are_awaited(monkeypatch):
    driver, submit, restarts, submitted = _stand_ins(monkeypatch, ["a", "b", "c"], set(), {})
    issued = restart.issue(driver, submit, [1])
    done = {0: "kept"}
    assert restart.each_engine(driver, submit, "generate", issued=issued, done=done) == ["kept", "b:1", "c:2"]
    assert submitted == ["b", "c"] and restarts == []
    assert done == {0: "kept", 1: "b:1", 2: "c:2"} and set(issued) == {1, 2}  # a rollout in flight keeps them


def test_an_error_an_engine_survived_is_raised_not_retried(monkeypatch):
    driver, submit, restarts, _ = _stand_ins(monkeypatch, ["a"], set(), {})

    def failing(refs, what, names):
        raise EngineDiedError("rollout engine 0 (generate): ValueError: bad prompt")

    monkeypatch.setattr("vime.cluster.remote.call", failing)
    with pytest.raises(EngineDiedError, match="bad prompt"):
        restart.each_engine(driver, submit, "generate")
    assert restarts == []
