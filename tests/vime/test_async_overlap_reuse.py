"""benchmarks/async_overlap.py reuses a finished run of its --workdir only when it was made by the same commit, the
same uncommitted changes and the same arguments; one of other settings is refused by name, never reported."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("async_overlap", REPO / "benchmarks" / "async_overlap.py")
ao = importlib.util.module_from_spec(_spec)
sys.modules["async_overlap"] = ao
_spec.loader.exec_module(ao)

KEY = {"commit": "a" * 40, "uncommitted": "", "overrides": ["steps=5", "algo.max_staleness=1"]}


def _finished(out: Path, key: dict | None) -> Path:
    out.mkdir()
    (out / "wall_s.txt").write_text("12.5\n")
    if key is not None:
        (out / ao.RUN_KEY).write_text(json.dumps(key))
    return out


def test_no_finished_run_is_run(tmp_path):
    assert not ao.reusable(tmp_path / "n1", KEY)


def test_the_same_settings_are_reused(tmp_path):
    assert ao.reusable(_finished(tmp_path / "n1", KEY), KEY)


@pytest.mark.parametrize(
    "other, named",
    [
        (KEY | {"commit": "b" * 40}, "commit"),
        (KEY | {"uncommitted": "0123456789abcdef"}, "uncommitted"),
        (KEY | {"overrides": ["steps=40", "algo.max_staleness=1"]}, "overrides"),
        (None, "commit, overrides, uncommitted"),  # a run of the script before it recorded its key
    ],
)
def test_other_settings_are_refused_by_name(tmp_path, other, named):
    out = _finished(tmp_path / "n1", other)
    with pytest.raises(SystemExit, match=f"{out} holds a finished run of other settings \\({named} differ"):
        ao.reusable(out, KEY)


def test_the_key_names_this_checkout():
    key = ao.run_key(["steps=3"])
    assert len(key["commit"]) == 40 and key["overrides"] == ["steps=3"]
