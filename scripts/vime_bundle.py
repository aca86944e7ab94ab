"""Pack a site tree into a checksummed, split archive (the GPU bundle) and stage it on an offline machine.

Standard library only: `stage` runs on the GPU image (Python 3.12, no extra packages needed), `pack` here.

Bundle layout (the folder `.bundle/` of the repository):
  manifest.json                      parts (name, size, sha256), the whole archive's sha256 and size, versions,
                                     and the optional add-ons (`addons`: name -> archive name, size, sha256, files)
  vime-site-<sha12>.tar.xz.<i>of<n>  the parts: `cat` of all of them, in order, is the archive
  vime-addon-<name>-<sha12>.tar.xz   an optional add-on (pack_addon): files the main archive stripped, restored
                                     into the site tree when carried (`moe`: native vLLM's MoE kernels, _moe_C)

`stage` (scripts/gpu_stage.sh) is run once per transfer: it verifies and moves arriving parts into a store that
outlives the transfer, and once every part is there assembles, verifies and unpacks the archive into a site
directory, writes the vLLM plugin's entry point there, and writes an env file exporting PYTHONPATH. An add-on
is optional: a session that carries none needs only the parts. One that arrives (in any transfer, before or after
the last part) is checked against the manifest's sha256 and kept in the store; once the site is unpacked its files
are installed into it, each checked against its own sha256, and a re-run finds them installed and does nothing.
Exit codes: 0 ready, 3 more parts needed, 1 an error (one line on stderr saying what to do), 2 bad usage.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1
READY, ERROR, USAGE, MORE_PARTS = 0, 1, 2, 3
MARKER = ".vime_bundle"  # in the site dir: the archive sha256 it was unpacked from
MIB = 2**20
_CHUNK = 4 * MIB


class StageError(Exception):
    """A condition the user must act on: its message is the one line printed."""


# ---------------------------------------------------------------------------------------------------- packing
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _tar_filter(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Reproducible members: no owners, no times; directories 755, files keep their executable bit."""
    if "__pycache__" in info.name.split("/"):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    if info.isdir():
        info.mode = 0o755
    elif info.isfile():
        info.mode = 0o755 if info.mode & 0o111 else 0o644
    return info


BIG = MIB  # files at least this large go last, grouped by package: similar binaries within xz's window


def _member_order(site: Path) -> list[Path]:
    """Every path under `site` in a fixed order: small files and folders by name, then big files by package
    and name (Ray's raylet, gcs_server and _raylet.so share much code; adjacent, xz finds it)."""
    paths = sorted(site.rglob("*"), key=lambda p: p.relative_to(site).as_posix())
    big = [p for p in paths if p.is_file() and not p.is_symlink() and p.stat().st_size >= BIG]
    small = [p for p in paths if p not in set(big)]
    big.sort(key=lambda p: (p.relative_to(site).parts[0], p.relative_to(site).as_posix()))
    return small + big


def _tar_tree(site: Path, out: io.RawIOBase | io.BufferedIOBase) -> None:
    """A tar stream of site's contents (names relative to it, in _member_order) written to `out`."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in _member_order(site):
            if path.is_dir() and not path.is_symlink():
                tar.add(path, arcname=path.relative_to(site).as_posix(), recursive=False, filter=_tar_filter)
            else:
                tar.add(path, arcname=path.relative_to(site).as_posix(), filter=_tar_filter)


def compress_tree(site: Path, archive: Path, level: str = "9e", dict_mib: int = 256, threads: int = 1) -> None:
    """`tar | xz -<level>` of the tree `site` into `archive` with a `dict_mib` dictionary (unpacking needs that
    much memory). One thread makes one block: every match across the whole tree counts (smallest); `threads`
    > 1 (xz binary only) cuts the tree into that many blocks compressed in parallel (faster, a little larger).
    The xz binary when there is one, else lzma."""
    preset = int(level.rstrip("e")) | (lzma.PRESET_EXTREME if level.endswith("e") else 0)
    tree = sum(p.stat().st_size for p in site.rglob("*") if p.is_file() and not p.is_symlink())
    dict_mib = max(1, min(dict_mib, 1 << max(0, (tree - 1).bit_length() - 20)))  # no bigger than the tree
    xz = shutil.which("xz")
    if xz:
        with open(archive, "wb") as f:
            args = [xz, f"-T{threads}", f"--lzma2=preset={level},dict={dict_mib}MiB", "-c"]
            if threads > 1:
                args.append(f"--block-size={-(-tree // threads) + MIB}")
            proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=f)
            assert proc.stdin is not None
            _tar_tree(site, proc.stdin)
            proc.stdin.close()
            if proc.wait() != 0:
                raise RuntimeError(f"xz -{level} failed with exit code {proc.returncode}")
    else:
        filters = [{"id": lzma.FILTER_LZMA2, "preset": preset, "dict_size": dict_mib * MIB}]
        with lzma.open(archive, "wb", format=lzma.FORMAT_XZ, filters=filters) as f:
            _tar_tree(site, f)


def split_archive(archive: Path, out_dir: Path, part_size: int, versions: dict, extra: dict | None = None) -> dict:
    """Split `archive` into the fewest parts of at most `part_size` bytes (sizes balanced), named after the
    archive's sha256, into `out_dir` together with manifest.json; old parts in `out_dir` are removed.
    Returns the manifest."""
    size = archive.stat().st_size
    digest = sha256_file(archive)
    n = max(1, -(-size // part_size))
    each = -(-size // n)
    stem = f"vime-site-{digest[:12]}.tar.xz"
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("vime-site-*.tar.xz.*of*"):
        old.unlink()
    parts = []
    with open(archive, "rb") as src:
        for i in range(1, n + 1):
            name = f"{stem}.{i}of{n}"
            h = hashlib.sha256()
            written = 0
            with open(out_dir / name, "wb") as dst:
                while written < each and (chunk := src.read(min(_CHUNK, each - written))):
                    dst.write(chunk)
                    h.update(chunk)
                    written += len(chunk)
            parts.append({"name": name, "size": written, "sha256": h.hexdigest()})
    manifest = {
        "format": FORMAT,
        "archive": {"name": stem, "size": size, "sha256": digest, "compression": "xz"},
        "parts": parts,
        "versions": versions,
        **(extra or {}),
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def pack(
    site: Path,
    out_dir: Path,
    part_size: int,
    versions: dict,
    extra: dict | None = None,
    level: str = "9e",
    work: Path | None = None,
    dict_mib: int = 256,
    threads: int = 1,
) -> dict:
    """compress_tree + split_archive; the whole archive is written to `work` (default out_dir) and removed."""
    archive = (work or out_dir) / "vime-site.tar.xz.tmp"
    archive.parent.mkdir(parents=True, exist_ok=True)
    try:
        compress_tree(site, archive, level, dict_mib, threads)
        return split_archive(archive, out_dir, part_size, versions, extra)
    finally:
        archive.unlink(missing_ok=True)


ADDON_GLOB = "vime-addon-*.tar.xz"


def addon_archive_name(name: str, digest: str) -> str:
    return f"vime-addon-{name}-{digest[:12]}.tar.xz"


def pack_addon(name: str, files: dict[str, bytes], out_dir: Path, level: str = "9e", work: Path | None = None) -> dict:
    """Pack `files` (site-relative path -> content) into the add-on archive `name` in `out_dir` and record it in
    out_dir's manifest.json under `addons` (the rest of the manifest, the parts and their names are untouched;
    an older archive of the same add-on is removed). Returns the add-on's manifest entry."""
    manifest_path = out_dir / MANIFEST
    manifest = _read_manifest(manifest_path)
    work = work or out_dir
    tree = work / f"addon-{name}.tree"
    archive = work / f"addon-{name}.tar.xz.tmp"
    shutil.rmtree(tree, ignore_errors=True)
    try:
        entries = []
        for rel, data in sorted(files.items()):
            dest = tree / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            entries.append({"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        compress_tree(tree, archive, level)
        digest = sha256_file(archive)
        final = out_dir / addon_archive_name(name, digest)
        for old in out_dir.glob(f"vime-addon-{name}-*.tar.xz"):
            old.unlink()
        shutil.move(str(archive), final)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
        archive.unlink(missing_ok=True)
    entry = {
        "name": final.name,
        "size": final.stat().st_size,
        "sha256": digest,
        "files": entries,
        "for_archive": manifest["archive"]["sha256"],
    }
    manifest.setdefault("addons", {})[name] = entry
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return entry


# ---------------------------------------------------------------------------------------------------- staging
def public_version(version: str) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0): the release numbers a `torch==` pin compares (local label dropped)."""
    release = re.match(r"\d+(\.\d+)*", version.split("+")[0].strip())
    if not release:
        raise StageError(f"gpu_stage: cannot read the version {version!r}")
    nums = [int(x) for x in release.group(0).split(".")]
    while len(nums) > 1 and nums[-1] == 0:
        nums.pop()
    return tuple(nums)


def machine_torch_version() -> str:
    """The installed torch's version from its metadata (importing torch takes seconds; this does not)."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise StageError(
            "gpu_stage: torch is not installed on this machine: the bundle brings everything but "
            "torch (and the image's other packages); use an image with torch"
        ) from None


def check_torch_pin(manifest: dict, torch_version: str) -> None:
    """The bundle's vLLM was built against one torch (`torch==` in its wheel); the machine must have it."""
    pin = manifest["versions"].get("torch_pin")
    if pin is None:
        return
    if public_version(pin) != public_version(torch_version):
        vllm = manifest["versions"].get("vllm", "?")
        raise StageError(
            f"gpu_stage: the bundle's vllm {vllm} needs torch=={pin} but this machine has torch {torch_version}: "
            f"rebuild the bundle with `bash scripts/gpu_bundle.sh --torch {torch_version.split('+')[0]}`"
        )


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StageError(
            f"gpu_stage: cannot read {path} ({e}): carry .bundle/{MANIFEST} from the "
            f"`scripts/gpu_bundle.sh` run whose parts you carry"
        ) from None
    if manifest.get("format") != FORMAT or "parts" not in manifest or "archive" not in manifest:
        raise StageError(
            f"gpu_stage: {path} is not a bundle manifest of format {FORMAT}: rebuild with `bash scripts/gpu_bundle.sh`"
        )
    return manifest


def _part_ok(path: Path, part: dict) -> bool:
    return path.stat().st_size == part["size"] and sha256_file(path) == part["sha256"]


def _concat(paths: Iterable[Path]) -> Iterable[bytes]:
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(_CHUNK):
                yield chunk


class _ChunkReader(io.RawIOBase):
    """A read-only stream over an iterable of byte chunks (the parts, in order, as one archive)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        while not self._buf:
            try:
                self._buf = next(self._it)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def _unpack_into(parts: list[Path], dest: Path) -> None:
    """Extract the xz tar made of `parts` (in order) into the existing folder `dest`."""
    stream = lzma.open(io.BufferedReader(_ChunkReader(_concat(parts)), _CHUNK), "rb")
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python < 3.11.4: the archive was verified against the manifest's sha256 first
            tar.extractall(dest)


def _unpack(parts: list[Path], site: Path) -> None:
    """Unpack the archive made of `parts` into `site` (atomically: a temp dir renamed over it)."""
    tmp = site.with_name(site.name + ".unpacking")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _unpack_into(parts, tmp)
    if site.exists():
        shutil.rmtree(site)
    tmp.rename(site)


def _plugin_dist_info(site: Path, repo: Path) -> None:
    """An installed-distribution record for the repository's entry points (vLLM finds its general plugins
    through `importlib.metadata` entry points; the project itself is on PYTHONPATH, not pip-installed)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        return
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    eps = project.get("entry-points", {})
    lines = []
    for group in sorted(eps):
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in sorted(eps[group].items())]
        lines.append("")
    name, version = project["name"], project.get("version", "0")
    for old in site.glob(f"{name}-*.dist-info"):
        shutil.rmtree(old)
    d = site / f"{name}-{version}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (d / "entry_points.txt").write_text("\n".join(lines))
    (d / "INSTALLER").write_text("scripts/gpu_stage.sh\n")


def _env_line(repo: Path, site: Path) -> str:
    # FlashInfer is not in the bundle: vLLM's sampler must not reach for it (its import is unguarded there)
    return f"export PYTHONPATH={repo}:{site}${{PYTHONPATH:+:$PYTHONPATH}} VLLM_USE_FLASHINFER_SAMPLER=0"


def _addon_entries(manifest: dict) -> dict[str, dict]:
    """archive file name -> add-on entry (with its `addon` name) of the manifest's add-ons for its archive."""
    out = {}
    for name, entry in sorted(manifest.get("addons", {}).items()):
        if entry.get("for_archive", manifest["archive"]["sha256"]) == manifest["archive"]["sha256"]:
            out[entry["name"]] = {**entry, "addon": name}
    return out


def _take_addons(incoming: Path, store: Path, manifest: dict, log) -> list[str]:
    """Move the add-on archives that arrived in `incoming` into `store`, each checked against the manifest
    first. Returns the problems (one clause each); a corrupt one is removed."""
    expected = _addon_entries(manifest)
    bad = []
    for path in sorted(incoming.glob(ADDON_GLOB)):
        entry = expected.get(path.name)
        if entry is None:
            bad.append(
                f"{path.name} is not an add-on of this manifest (its add-ons: "
                f"{', '.join(expected) or 'none'}): carry the manifest.json that `scripts/gpu_bundle.py --addon` "
                f"wrote with it"
            )
            continue
        if not _part_ok(path, entry):
            bad.append(
                f"{path.name} is corrupt (size or sha256 differs from the manifest): carry .bundle/{path.name} "
                f"again (or rebuild it with `python scripts/gpu_bundle.py --addon {entry['addon']}`)"
            )
            path.unlink()
            continue
        store.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), store / path.name)
        log(f"gpu_stage: add-on {entry['addon']} ({path.name}) verified, kept in {store}")
    return bad


def _addon_installed(site: Path, entry: dict) -> bool:
    return all(
        (site / f["path"]).is_file()
        and (site / f["path"]).stat().st_size == f["size"]
        and sha256_file(site / f["path"]) == f["sha256"]
        for f in entry["files"]
    )


def _install_addons(store: Path, site: Path, manifest: dict, log, note_missing: bool) -> None:
    """Install into the unpacked `site` every add-on of the manifest whose archive is in `store` and whose files
    are not there yet (checked by sha256: a re-run does nothing). Files are unpacked next to the site, checked
    against the manifest, then renamed into place. With `note_missing`, one line per add-on not carried."""
    for archive_name, entry in _addon_entries(manifest).items():
        path = store / archive_name
        if _addon_installed(site, entry):
            continue
        if not path.is_file():
            if note_missing:
                log(f"gpu_stage: add-on {entry['addon']} not carried (optional: carry .bundle/{archive_name})")
            continue
        if not _part_ok(path, entry):
            path.unlink()
            raise StageError(
                f"gpu_stage: the stored add-on {archive_name} no longer matches the manifest: it was removed "
                f"from {store}; carry .bundle/{archive_name} again"
            )
        tmp = site.with_name(site.name + f".addon-{entry['addon']}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            _unpack_into([path], tmp)
            for f in entry["files"]:
                got = tmp / f["path"]
                if not got.is_file() or sha256_file(got) != f["sha256"]:
                    raise StageError(
                        f"gpu_stage: add-on {archive_name} unpacked {f['path']} with another sha256 than the "
                        f"manifest's: rebuild it with `python scripts/gpu_bundle.py --addon {entry['addon']}`"
                    )
            for f in entry["files"]:
                (site / f["path"]).parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp / f["path"], site / f["path"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(
            f"gpu_stage: add-on {entry['addon']} installed into {site}: "
            f"{', '.join(f['path'] for f in entry['files'])} (sha256 checked)"
        )


def stage(
    incoming: Path,
    store: Path,
    site: Path,
    repo: Path,
    env_file: Path | None,
    torch_version: str | None = None,
    log=print,
) -> int:
    """One staging step (see the module docstring). Returns READY or MORE_PARTS; raises StageError."""
    manifest_path = incoming / MANIFEST
    if not manifest_path.is_file() and (store / MANIFEST).is_file():
        manifest_path = store / MANIFEST  # a later transfer may bring only parts
    if not manifest_path.is_file():
        raise StageError(
            f"gpu_stage: no {incoming / MANIFEST}: carry .bundle/{MANIFEST} (with the parts) from "
            f"`bash scripts/gpu_bundle.sh`"
        )
    manifest = _read_manifest(manifest_path)
    check_torch_pin(manifest, torch_version or machine_torch_version())
    digest = manifest["archive"]["sha256"]
    env = _env_line(repo.resolve(), site.resolve())

    def ready() -> int:
        if env_file is not None:
            env_file.parent.mkdir(parents=True, exist_ok=True)
            env_file.write_text(env + "\n")
        log(env)
        return READY

    marker = site / MARKER
    if marker.is_file() and marker.read_text().strip() == digest:
        if manifest_path != store / MANIFEST and manifest.get("addons"):
            store.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(manifest_path, store / MANIFEST)  # its add-ons, for a later transfer without it
        bad = _take_addons(incoming, store, manifest, log)
        if bad:
            raise StageError("gpu_stage: " + "; ".join(bad))
        _install_addons(store, site, manifest, log, note_missing=False)
        return ready()  # already unpacked: nothing to verify again (an add-on's files only, by sha256)

    # Keep the store to this bundle: parts or a manifest of another bundle are stale.
    store.mkdir(parents=True, exist_ok=True)
    stored = store / MANIFEST
    if stored.is_file() and _read_manifest(stored)["archive"]["sha256"] != digest:
        for old in store.iterdir():
            old.unlink()
    if manifest_path != stored:
        shutil.copyfile(manifest_path, stored)

    expected = {p["name"]: p for p in manifest["parts"]}
    bad = []
    for path in sorted(incoming.glob("vime-site-*.tar.xz.*of*")):
        part = expected.get(path.name)
        if part is None:
            bad.append(
                f"{path.name} belongs to another bundle (this manifest's parts are "
                f"{manifest['archive']['name']}.*): carry the manifest.json built with it"
            )
            continue
        if not _part_ok(path, part):
            bad.append(
                f"{path.name} is corrupt (size or sha256 differs from the manifest): carry .bundle/"
                f"{path.name} again (or rebuild with `bash scripts/gpu_bundle.sh`)"
            )
            path.unlink()
            continue
        shutil.move(str(path), store / path.name)
        log(f"gpu_stage: {path.name} verified, kept in {store}")
    bad += _take_addons(incoming, store, manifest, log)
    if bad:
        raise StageError("gpu_stage: " + "; ".join(bad))

    have = [n for n in expected if (store / n).is_file()]
    missing = [n for n in expected if n not in have]
    if missing:
        log(
            f"gpu_stage: {len(have)} of {len(expected)} parts in {store}; still missing: {', '.join(missing)} "
            f"(carry .bundle/{missing[0]} and .bundle/{MANIFEST} in the next transfer)"
        )
        return MORE_PARTS

    paths = [store / n for n in expected]  # the manifest's order
    h = hashlib.sha256()
    for chunk in _concat(paths):
        h.update(chunk)
    if h.hexdigest() != digest:
        for p in paths:
            p.unlink()
        raise StageError(
            f"gpu_stage: the assembled archive's sha256 differs from the manifest's ({digest[:12]}): "
            f"every part was removed from {store}; carry all parts again"
        )
    t0 = time.time()
    _unpack(paths, site)
    _check_unpacked_pin(site, manifest)
    _plugin_dist_info(site, repo)
    marker.write_text(digest + "\n")
    log(
        f"gpu_stage: unpacked {manifest['archive']['name']} into {site} in {time.time() - t0:.1f} s "
        f"({', '.join(f'{k} {v}' for k, v in sorted(manifest['versions'].items()))})"
    )
    _install_addons(store, site, manifest, log, note_missing=True)
    return ready()


def _check_unpacked_pin(site: Path, manifest: dict) -> None:
    """The unpacked vLLM's own METADATA must pin the torch the manifest says (the stage's check relied on it)."""
    pin = manifest["versions"].get("torch_pin")
    vllm = manifest["versions"].get("vllm")
    if not (pin and vllm):
        return
    meta = site / f"vllm-{vllm}.dist-info" / "METADATA"
    found = re.findall(r"^Requires-Dist: torch==([^\s;]+)", meta.read_text(), re.M) if meta.is_file() else []
    if found != [pin]:
        raise StageError(
            f"gpu_stage: the unpacked vllm's METADATA pins torch {found or 'nothing'}, the manifest "
            f"says {pin}: rebuild with `bash scripts/gpu_bundle.sh`"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Stage the GPU bundle's parts (scripts/gpu_stage.sh).")
    ap.add_argument("--incoming", type=Path, default=Path(".bundle"), help="where parts arrive (default .bundle)")
    ap.add_argument("--store", type=Path, default=Path(os.environ.get("VIME_BUNDLE_STORE", "/root/vime_bundle")))
    ap.add_argument("--site", type=Path, default=Path(os.environ.get("VIME_SITE", "/root/vime_site")))
    ap.add_argument("--repo", type=Path, default=Path("."), help="repository root (default .)")
    ap.add_argument(
        "--env-file",
        type=Path,
        default=Path(".bundle/env.sh"),
        help="file that gets the `export PYTHONPATH=...` line (default .bundle/env.sh)",
    )
    ap.add_argument("--torch-version", default=None, help="the machine's torch version (default: installed)")
    args = ap.parse_args(argv)
    try:
        return stage(args.incoming, args.store, args.site, args.repo, args.env_file, args.torch_version)
    except StageError as e:
        print(str(e), file=sys.stderr)
        return ERROR


if __name__ == "__main__":
    sys.exit(main())
