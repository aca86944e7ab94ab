"""A step whose weight sync met a dead engine records the bytes the restarted engine loaded (it loads the new
version itself, so the retried sync pushes nothing to it; the row used to say 0 bytes). Pure logic of
`vime.faults.restart.sync`: the engines are stand-ins; the restart itself is tested end to end in
tests/vime/test_resume.py (extended)."""

from __future__ import annotations

from types import SimpleNamespace

from vime.errors import EngineDiedError
from vime.faults import restart

RETRY = {"sync_s": 0.5, "sync_bytes": 0.0, "sync_buckets": 0.0, "sync_gbps": 0.0, "sync_transports": ["gloo"] * 2}
RELOAD = {"sync_s": 1.5, "sync_bytes": 4e9, "sync_buckets": 4.0, "sync_gbps": 4e9 / 1.5 / 1e9}


def test_a_sync_that_met_a_dead_engine_counts_what_its_restart_loaded(monkeypatch):
    dead = object()
    driver = SimpleNamespace(engines=[dead, object()])
    attempts = []

    def sync_fn() -> dict:
        attempts.append(1)
        if len(attempts) == 1:
            raise EngineDiedError("rollout engine 0 died during 'load weights'")
        return dict(RETRY)  # every engine serves the version already: nothing left to push

    def restarted(d, i, cause, who):
        d.engines[i] = object()
        return dict(RELOAD)

    monkeypatch.setattr(restart, "_alive", lambda actor: actor is not dead)
    monkeypatch.setattr(restart, "served_versions", lambda d, engines: None)
    monkeypatch.setattr(restart, "restart_engine", restarted)
    out = restart.sync(driver, sync_fn)
    assert len(attempts) == 2
    assert (out["sync_bytes"], out["sync_buckets"], out["sync_s"]) == (4e9, 4.0, 2.0)
    assert out["sync_gbps"] == 2.0 and out["sync_transports"] == ["gloo"] * 2


def test_a_sync_without_restarts_is_what_it_measured():
    assert restart.with_reloads(dict(RETRY), []) == RETRY
    assert restart.sync(SimpleNamespace(engines=[]), lambda: dict(RELOAD)) == RELOAD
