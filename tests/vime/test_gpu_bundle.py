"""The GPU bundle's packing and staging (scripts/vime_bundle.py, scripts/gpu_stage.sh) on a tiny fake bundle
built by the same packing code: parts arriving one per transfer, a corrupt or foreign part refused by name, the
missing parts reported (exit 3), an idempotent re-run, a torch-pin mismatch refused before anything is unpacked.
Also the build script's pure helpers (torch pin of a METADATA, requirement closure). No network."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.slow  # the bundle is packed with the xz binary and staged by the stage script


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


vb = _load("vime_bundle")
TORCH = "2.11.0"
VLLM_META = f"Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0\nRequires-Dist: numpy\nRequires-Dist: torch=={TORCH}\n"


def _fake_site(root: Path) -> Path:
    """A small site tree shaped like the real one: vllm with its dist-info pin, an executable, a nested package;
    incompressible bytes so that it splits into several parts."""
    site = root / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("__version__ = '0.26.0'\n")
    (site / "vllm" / "blob.bin").write_bytes(os.urandom(150_000))
    (site / "vllm-0.26.0.dist-info").mkdir()
    (site / "vllm-0.26.0.dist-info" / "METADATA").write_text(VLLM_META)
    exe = site / "ray" / "core" / "raylet"
    exe.parent.mkdir(parents=True)
    exe.write_bytes(b"#!/bin/sh\necho raylet\n")
    exe.chmod(0o755)
    return site


@pytest.fixture
def bundle(tmp_path: Path) -> dict:
    """A repository copy (pyproject.toml is what the stage reads) with a 3-part bundle in .bundle/."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")
    built = tmp_path / "built"
    manifest = vb.pack(_fake_site(tmp_path), built, 60_000, {"vllm": "0.26.0", "torch_pin": TORCH}, level="1")
    assert len(manifest["parts"]) == 3
    (repo / ".bundle").mkdir()
    return {
        "repo": repo,
        "built": built,
        "manifest": manifest,
        "store": tmp_path / "store",
        "site": tmp_path / "vsite",
        "env": repo / ".bundle" / "env.sh",
    }


def _carry(b: dict, *indices: int) -> None:
    """One transfer: the manifest plus the parts with these indices land in the repository's .bundle/."""
    shutil.copy(b["built"] / vb.MANIFEST, b["repo"] / ".bundle" / vb.MANIFEST)
    for i in indices:
        name = b["manifest"]["parts"][i]["name"]
        shutil.copy(b["built"] / name, b["repo"] / ".bundle" / name)


def _stage(b: dict, torch_version: str = TORCH + "+cu130") -> tuple[int, list[str]]:
    lines: list[str] = []
    rc = vb.stage(b["repo"] / ".bundle", b["store"], b["site"], b["repo"], b["env"], torch_version, log=lines.append)
    return rc, lines


def test_parts_arrive_one_per_transfer_then_unpack(bundle: dict) -> None:
    names = [p["name"] for p in bundle["manifest"]["parts"]]
    sizes = [p["size"] for p in bundle["manifest"]["parts"]]
    assert max(sizes) <= 60_000 and sum(sizes) == bundle["manifest"]["archive"]["size"]
    for i in range(2):
        _carry(bundle, i)
        rc, lines = _stage(bundle)
        assert rc == vb.MORE_PARTS
        assert f"{i + 1} of 3 parts" in lines[-1] and names[2] in lines[-1]
        assert not (bundle["repo"] / ".bundle" / names[i]).exists()  # moved into the store
        assert not bundle["site"].exists()
    _carry(bundle, 2)
    rc, lines = _stage(bundle)
    assert rc == vb.READY
    site = bundle["site"]
    assert (site / "vllm" / "__init__.py").read_text() == "__version__ = '0.26.0'\n"
    assert os.access(site / "ray" / "core" / "raylet", os.X_OK)
    eps = (site / "vime-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]" in eps and "rl_kernel = rl_kernel.integrations.vllm:register" in eps
    expected = (
        f"export PYTHONPATH={bundle['repo'].resolve()}:{site.resolve()}${{PYTHONPATH:+:$PYTHONPATH}} "
        "VLLM_USE_FLASHINFER_SAMPLER=0"
    )  # FlashInfer is not in the bundle
    assert lines[-1] == expected and bundle["env"].read_text().strip() == expected


def test_entry_point_is_found_through_importlib_metadata(bundle: dict) -> None:
    _carry(bundle, 0, 1, 2)
    assert _stage(bundle)[0] == vb.READY
    code = (
        "from importlib.metadata import entry_points; "
        "print([e.value for e in entry_points(group='vllm.general_plugins') if e.name == 'rl_kernel'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(bundle["site"])},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "rl_kernel.integrations.vllm:register" in out


def test_rerun_when_unpacked_is_a_noop(bundle: dict) -> None:
    _carry(bundle, 0, 1, 2)
    assert _stage(bundle)[0] == vb.READY
    marker = (bundle["site"] / vb.MARKER).stat().st_mtime_ns
    (bundle["site"] / "vllm" / "touched").write_text("kept")  # a re-unpack would remove this
    _carry(bundle)  # a later transfer: only the manifest
    start = time.perf_counter()
    rc, lines = _stage(bundle)
    assert rc == vb.READY and len(lines) == 1 and lines[0].startswith("export PYTHONPATH=")
    assert (bundle["site"] / "vllm" / "touched").read_text() == "kept"
    assert (bundle["site"] / vb.MARKER).stat().st_mtime_ns == marker
    assert time.perf_counter() - start < 5  # generous: the contract is "no work", checked above


def test_corrupt_part_is_refused_by_name_and_good_parts_are_kept(bundle: dict) -> None:
    names = [p["name"] for p in bundle["manifest"]["parts"]]
    _carry(bundle, 0, 1)
    bad = bundle["repo"] / ".bundle" / names[1]
    data = bytearray(bad.read_bytes())
    data[100] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(vb.StageError) as err:
        _stage(bundle)
    msg = str(err.value)
    assert "\n" not in msg and names[1] in msg and "corrupt" in msg and "carry .bundle/" + names[1] in msg
    assert (bundle["store"] / names[0]).is_file() and not (bundle["store"] / names[1]).exists()
    _carry(bundle, 1, 2)  # carried again, intact
    assert _stage(bundle)[0] == vb.READY


def test_part_of_another_bundle_is_refused(bundle: dict, tmp_path: Path) -> None:
    other = vb.pack(
        _fake_site(tmp_path / "other"),
        tmp_path / "other_built",
        60_000,
        {"vllm": "0.26.0", "torch_pin": TORCH},
        level="1",
    )
    _carry(bundle)
    stray = other["parts"][0]["name"]
    shutil.copy(tmp_path / "other_built" / stray, bundle["repo"] / ".bundle" / stray)
    with pytest.raises(vb.StageError, match=f"{stray} belongs to another bundle"):
        _stage(bundle)


def test_missing_manifest_and_missing_parts(bundle: dict) -> None:
    with pytest.raises(vb.StageError, match="carry .bundle/manifest.json"):
        _stage(bundle)
    _carry(bundle, 2)
    rc, lines = _stage(bundle)
    names = [p["name"] for p in bundle["manifest"]["parts"]]
    assert rc == vb.MORE_PARTS and f"still missing: {names[0]}, {names[1]}" in lines[-1]


def test_torch_pin_mismatch_is_refused_before_anything_moves(bundle: dict) -> None:
    _carry(bundle, 0)
    with pytest.raises(vb.StageError) as err:
        _stage(bundle, torch_version="2.13.0+cu130")
    msg = str(err.value)
    assert "\n" not in msg and "vllm 0.26.0 needs torch==2.11.0" in msg and "torch 2.13.0+cu130" in msg
    assert "scripts/gpu_bundle.sh --torch 2.13.0" in msg
    assert (bundle["repo"] / ".bundle" / bundle["manifest"]["parts"][0]["name"]).is_file()
    assert not bundle["store"].exists()


def test_assembled_archive_checked_against_the_manifest(bundle: dict) -> None:
    """Parts that each match their checksum but a manifest whose whole-archive sha256 differs: nothing is
    unpacked, the store is emptied, the error says to carry all parts again."""
    manifest = json.loads((bundle["built"] / vb.MANIFEST).read_text())
    manifest["archive"]["sha256"] = "0" * 64
    (bundle["built"] / vb.MANIFEST).write_text(json.dumps(manifest))
    _carry(bundle, 0, 1, 2)
    with pytest.raises(vb.StageError, match="carry all parts again"):
        _stage(bundle)
    assert not bundle["site"].exists() and not list(bundle["store"].glob("vime-site-*"))


def test_new_bundle_replaces_the_old_one(bundle: dict, tmp_path: Path) -> None:
    _carry(bundle, 0, 1, 2)
    assert _stage(bundle)[0] == vb.READY
    site2 = _fake_site(tmp_path / "v2")
    (site2 / "vllm" / "__init__.py").write_text("__version__ = 'second'\n")
    m2 = vb.pack(site2, bundle["built"], 10**9, {"vllm": "0.26.0", "torch_pin": TORCH}, level="1")
    assert len(m2["parts"]) == 1
    bundle["manifest"] = m2
    _carry(bundle, 0)
    assert _stage(bundle)[0] == vb.READY
    assert (bundle["site"] / "vllm" / "__init__.py").read_text() == "__version__ = 'second'\n"
    assert sorted(p.name for p in bundle["store"].iterdir()) == sorted([vb.MANIFEST, m2["parts"][0]["name"]])


def test_stage_script_exit_codes(bundle: dict) -> None:
    """scripts/gpu_stage.sh end to end: 3 while parts are missing, 1 with one line on a bad one, 0 when ready."""
    script = REPO / "scripts" / "vime_bundle.py"

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                str(script),
                "--store",
                str(bundle["store"]),
                "--site",
                str(bundle["site"]),
                "--torch-version",
                "2.11.0+cu130",
                *extra,
            ],
            cwd=bundle["repo"],
            capture_output=True,
            text=True,
        )

    _carry(bundle, 0)
    assert run().returncode == vb.MORE_PARTS
    r = run("--torch-version", "2.14.0")
    assert r.returncode == vb.ERROR and len(r.stderr.strip().splitlines()) == 1
    _carry(bundle, 1, 2)
    r = run()
    assert r.returncode == vb.READY and r.stdout.strip().splitlines()[-1].startswith("export PYTHONPATH=")
    assert (bundle["repo"] / ".bundle" / "env.sh").is_file()


@pytest.mark.parametrize(
    ("machine", "ok"),
    [("2.11.0+cu130", True), ("2.11", True), ("2.11.0", True), ("2.11.1+cu130", False), ("2.13.0", False)],
)
def test_torch_pin_compares_release_numbers(machine: str, ok: bool) -> None:
    manifest = {"versions": {"vllm": "0.26.0", "torch_pin": "2.11.0"}}
    if ok:
        vb.check_torch_pin(manifest, machine)
    else:
        with pytest.raises(vb.StageError):
            vb.check_torch_pin(manifest, machine)


def test_build_helpers_read_pins_and_requirements(tmp_path: Path) -> None:
    gb = _load("gpu_bundle")
    assert gb.torch_pin(VLLM_META) == TORCH
    assert gb.torch_pin("Requires-Dist: torch>=2.0\nRequires-Dist: torch==9; extra == 'x'\n") is None
    site = tmp_path / "s"
    for name, version, reqs in [
        ("a", "1.0", ["b>=2", "numpy", "mistral_common[image]>=1", "c; python_version<'3'"]),
        ("b", "2.1", []),
    ]:
        d = site / f"{name}-{version}.dist-info"
        d.mkdir(parents=True)
        (d / "METADATA").write_text(
            f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in reqs)
        )
    assert gb.check_requirements(gb.installed(site), "3.12") == ["numpy"]
    (site / "a-1.0.dist-info" / "METADATA").write_text("Name: a\nVersion: 1.0\nRequires-Dist: b>=3\n")
    with pytest.raises(SystemExit, match="a needs b>=3, the bundle has b 2.1"):
        gb.check_requirements(gb.installed(site), "3.12")
    (site / "a-1.0.dist-info" / "METADATA").write_text("Name: a\nVersion: 1.0\nRequires-Dist: nowhere\n")
    with pytest.raises(SystemExit, match="not in the bundle, not on the image"):
        gb.check_requirements(gb.installed(site), "3.12")


# ------------------------------------------------------------------------------------------ optional add-ons
MOE = "vllm/_moe_C_stable_libtorch.abi3.so"


def _with_addon(b: dict) -> dict:
    """The bundle's built manifest gains an add-on `moe` (one incompressible file); its parts stay as they were."""
    before = [dict(p) for p in json.loads((b["built"] / vb.MANIFEST).read_text())["parts"]]
    entry = vb.pack_addon("moe", {MOE: os.urandom(70_000)}, b["built"], level="1")
    manifest = json.loads((b["built"] / vb.MANIFEST).read_text())
    assert manifest["parts"] == before and manifest["addons"]["moe"] == entry
    assert entry["name"].startswith("vime-addon-moe-") and entry["files"][0]["path"] == MOE
    b["addon"] = entry
    return entry


def _carry_addon(b: dict) -> None:
    shutil.copy(b["built"] / vb.MANIFEST, b["repo"] / ".bundle" / vb.MANIFEST)
    shutil.copy(b["built"] / b["addon"]["name"], b["repo"] / ".bundle" / b["addon"]["name"])


def _moe_sha(b: dict) -> str:
    return vb.sha256_file(b["site"] / MOE)


def test_dense_session_needs_only_the_parts_and_a_later_addon_is_installed(bundle: dict) -> None:
    entry = _with_addon(bundle)
    _carry(bundle, 0, 1, 2)  # the manifest names the add-on; it is not carried
    rc, lines = _stage(bundle)
    assert rc == vb.READY and not (bundle["site"] / MOE).exists()
    assert any("add-on moe not carried" in line and entry["name"] in line for line in lines)
    _carry_addon(bundle)  # a later transfer: the add-on and the manifest
    rc, lines = _stage(bundle)
    assert rc == vb.READY and _moe_sha(bundle) == entry["files"][0]["sha256"]
    assert any("add-on moe installed" in line for line in lines)
    assert (bundle["store"] / entry["name"]).is_file() and not (bundle["repo"] / ".bundle" / entry["name"]).exists()
    mtime = (bundle["site"] / MOE).stat().st_mtime_ns
    _carry(bundle)  # re-staging: nothing to do
    rc, lines = _stage(bundle)
    assert rc == vb.READY and len(lines) == 1 and (bundle["site"] / MOE).stat().st_mtime_ns == mtime


def test_addon_before_the_last_part_is_installed_after_the_unpack(bundle: dict) -> None:
    entry = _with_addon(bundle)
    _carry_addon(bundle)
    _carry(bundle, 0)
    assert _stage(bundle)[0] == vb.MORE_PARTS and not bundle["site"].exists()
    _carry(bundle, 1, 2)
    assert _stage(bundle)[0] == vb.READY and _moe_sha(bundle) == entry["files"][0]["sha256"]


def test_addon_file_changed_in_the_site_is_reinstalled_from_the_store(bundle: dict) -> None:
    entry = _with_addon(bundle)
    _carry(bundle, 0, 1, 2)
    _carry_addon(bundle)
    assert _stage(bundle)[0] == vb.READY
    (bundle["site"] / MOE).write_bytes(b"truncated")
    _carry(bundle)
    rc, lines = _stage(bundle)
    assert rc == vb.READY and _moe_sha(bundle) == entry["files"][0]["sha256"]
    assert any("add-on moe installed" in line for line in lines)


def test_corrupt_or_foreign_addon_is_refused_by_name(bundle: dict, tmp_path: Path) -> None:
    entry = _with_addon(bundle)
    _carry(bundle, 0, 1, 2)
    assert _stage(bundle)[0] == vb.READY
    _carry_addon(bundle)
    bad = bundle["repo"] / ".bundle" / entry["name"]
    data = bytearray(bad.read_bytes())
    data[-40] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(vb.StageError) as err:
        _stage(bundle)
    msg = str(err.value)
    assert "\n" not in msg and entry["name"] in msg and "corrupt" in msg and "--addon moe" in msg
    assert not bad.exists() and not (bundle["site"] / MOE).exists()
    stray = bundle["repo"] / ".bundle" / "vime-addon-moe-000000000000.tar.xz"
    stray.write_bytes(b"x")
    with pytest.raises(vb.StageError, match="is not an add-on of this manifest"):
        _stage(bundle)


def test_build_addon_refuses_a_path_the_main_archive_keeps(tmp_path: Path) -> None:
    gb = _load("gpu_bundle")
    out, wheels = tmp_path / "out", tmp_path / "cache" / "wheels"
    out.mkdir()
    wheels.mkdir(parents=True)
    (out / vb.MANIFEST).write_text(
        json.dumps({"format": 1, "archive": {"sha256": "a" * 64}, "parts": [], "versions": {"vllm": "0.26.0"}})
    )
    with zipfile.ZipFile(wheels / "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as z:
        z.writestr(MOE, b"kernels")
    with pytest.raises(SystemExit, match="is in the main archive already"):
        gb.build_addon("moe", out, tmp_path / "cache", "1", REPO)
    manifest = json.loads((out / vb.MANIFEST).read_text())
    manifest["stripped"] = [MOE]
    (out / vb.MANIFEST).write_text(json.dumps(manifest))
    entry = gb.build_addon("moe", out, tmp_path / "cache", "1", REPO)
    assert entry["files"] == [{"path": MOE, "size": 7, "sha256": hashlib.sha256(b"kernels").hexdigest()}]
    assert json.loads((out / vb.MANIFEST).read_text())["addons"]["moe"]["sha256"] == entry["sha256"]
