"""Build the GPU bundle (scripts/gpu_bundle.sh): everything `python -m vime.train` needs on an offline GPU machine
whose image has torch (and the common packages listed in IMAGE) but not vLLM, Ray, Hydra or megatron-core.

Steps (each printed): choose vLLM by its wheel's `torch==` pin (newest release first; the pins are read from the
index's per-wheel METADATA, no wheel download), download every wheel (cached in --cache), install them with
`pip install --target` into one site tree, strip what a dense Qwen3 on Hopper never loads (STRIP), check that
every requirement of what was installed is met by the tree or the image (or is left out on purpose: LEFT_OUT),
then `tar | xz -9e` the tree and split it into parts that each fit one transfer beside the repository
(vime_bundle.split_archive), with manifest.json. Needs internet and a Python with pip (any version: the
wheels are chosen for --python).

Add-ons (`python scripts/gpu_bundle.py --addon moe`): a separate small archive of files the main archive strips,
taken from the cached vLLM wheel (--cache, the version the manifest names) without rebuilding or touching the
parts; written as --out/vime-addon-<name>-<sha12>.tar.xz and recorded in --out/manifest.json under `addons`
(sha256, size, and each file's sha256). scripts/gpu_stage.sh installs a carried add-on into the unpacked site
tree; a session that carries none needs only the parts. One add-on per transfer (it does not fit beside a part):
  moe   vllm/_moe_C_stable_libtorch.abi3.so (native vLLM's MoE kernels, 47 MB; about 40 MB compressed)
A full rebuild writes a new manifest without add-ons: run --addon again after it. No network.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vime_bundle  # noqa: E402

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ModuleNotFoundError:  # pip always carries its own copy
    from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

MIB = vime_bundle.MIB

# What the bundle ships besides vLLM, at these exact versions (the CPU venv's constraints.txt where it has the
# package; otherwise the version run with vLLM 0.26 on the H200).
PINS = {
    # vLLM's runtime requirements that the image lacks
    "annotated-types": "0.8.0",
    "apache-tvm-ffi": "0.1.11",
    "astor": "0.8.1",
    "blake3": "1.0.11",
    "cachetools": "8.0.2",
    "cbor2": "6.3.0",
    "compressed-tensors": "0.17.0",
    "depyf": "0.20.0",
    "dill": "0.4.1",
    "diskcache": "5.6.3",
    "distro": "1.9.0",
    "fastapi": "0.136.3",
    "gguf": "0.19.0",
    "ijson": "3.6.0",
    "interegular": "0.3.3",
    "jiter": "0.19.0",
    "lark": "1.2.2",
    "llguidance": "1.7.6",
    "lm-format-enforcer": "0.11.3",
    "loguru": "0.7.3",
    "msgspec": "0.23.0",
    "nvtx": "0.2.15",
    "openai": "2.54.0",
    "openai-harmony": "0.0.8",
    "outlines-core": "0.2.14",
    "partial-json-parser": "0.2.1.1.post7",
    "prometheus-fastapi-instrumentator": "8.1.0",
    "pybase64": "1.5.1",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "python-json-logger": "4.2.0",
    "pyzmq": "27.3.0",
    "setproctitle": "1.3.8",
    "sniffio": "1.3.1",
    "starlette": "1.10.0",
    "typing-inspection": "0.4.5",
    "watchfiles": "1.3.0",
    "xgrammar": "0.2.9",
    # vime's own (Ray driver and actors, Hydra config, the Megatron trainer)
    "ray": "2.60.0",
    "jsonschema": "4.26.0",
    "jsonschema-specifications": "2025.9.1",
    "referencing": "0.37.0",
    "rpds-py": "2026.9.1",
    "hydra-core": "1.3.8",
    "omegaconf": "2.3.1",
    "antlr4-python3-runtime": "4.9.3",
    "megatron-core": "0.19.2",
}
SDIST_ONLY = {"antlr4-python3-runtime"}  # built into a (pure-Python) wheel here
# Requirements knowingly not met by the bundle, with why; a requirement met neither by the tree, nor by the
# image, nor listed here fails the build.
LEFT_OUT = {
    "mistral-common": "must NOT be present: transformers' tokenizer auto-detection imports it, then fails on pycountry",
    "apache-tvm-ffi": "vLLM pins 0.1.10, whose load_lib_module() lacks extra_lib_paths that xgrammar 0.2.9 calls",
    "anthropic": "API server only",
    "mcp": "API server only",
    "model-hosting-container-standards": "API server only",
    "opentelemetry-sdk": "tracing only",
    "opentelemetry-api": "tracing only",
    "opentelemetry-exporter-otlp": "tracing only",
    "opentelemetry-semantic-conventions-ai": "tracing only",
    "flashinfer-python": "optional kernels (a dense Qwen3 on Hopper uses FA3)",
    "tilelang": "optional kernels",
    "quack-kernels": "optional kernels",
    "nvidia-cutlass-dsl": "optional kernels (FA4, Blackwell)",
    "tokenspeed-mla": "MLA models only",
    "humming-kernels": "optional kernels",
    "nvidia-cudnn-frontend": "optional kernels",
    "fastsafetensors": "optional loader",
    "pynvvideocodec": "video inputs only",
    "torchcodec": "audio/video inputs only",
}
# The image's distributions (names), as listed for the GPU machines' image; their versions are not checked.
IMAGE = set(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)
# Paths (relative to the site tree; a trailing / is a folder, * a glob) a dense Qwen3 on Hopper never loads.
STRIP = (
    "bin/",  # console scripts, with this machine's interpreter
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FA2: its import is guarded; Hopper runs FA3
    "vllm/_moe_C_stable_libtorch.abi3.so",  # MoE kernels: import suppressed for dense models
    "vllm/vllm-rs",  # Rust frontend binary
    "vllm/third_party/fmha_sm100/",  # Blackwell attention
    "vllm/third_party/deep_gemm/include/",  # DeepGEMM JIT headers (FP8 only)
    "vllm/third_party/deep_gemm/_C.cpython-3*",  # (other Pythons' builds; the 3.12 one is kept below)
    "vllm/_flashmla*",  # MLA models only
    "vllm/_qutlass_C*",  # FP4 kernels
    "vllm/entrypoints/serve/instrumentator/static/",  # swagger UI of the API server
    "ray/jars/",  # Java workers
    "ray/dashboard/client/build/",  # dashboard web client (vime runs without dashboard)
)
MUST_HAVE = (
    "vllm/_C_stable_libtorch.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "ray/_raylet.so",
    "ray/core/src/ray/raylet/raylet",
    "megatron/core/__init__.py",
    "hydra/__init__.py",
    "omegaconf/__init__.py",
    "antlr4/__init__.py",
    "pydantic/__init__.py",
    "xgrammar/__init__.py",
)
MUST_NOT_HAVE = ("mistral_common",)
# Optional add-ons: name -> site-relative paths (each one STRIP removed) packed from the cached vLLM wheel.
ADDONS = {"moe": ("vllm/_moe_C_stable_libtorch.abi3.so",)}


def say(msg: str) -> None:
    print(f"gpu_bundle: {msg}", flush=True)


def platform_args(python: str, platforms: list[str]) -> list[str]:
    out = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for p in platforms:
        out += ["--platform", p]
    return out


def _get(url: str, accept: str | None = None) -> bytes:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


class _RemoteFile(io.RawIOBase):
    """A seekable read-only view of a file on an HTTP server that honours Range requests: enough for zipfile
    to read one member (a wheel's METADATA) without downloading the wheel."""

    def __init__(self, url: str) -> None:
        self.url, self.pos = url, 0
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as r:
            self.size = int(r.headers["Content-Length"])

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.size}[whence] + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            if r.status != 206:
                raise OSError(f"{self.url}: the server ignored a Range request")
            data = r.read()
        self.pos += len(data)
        return data


def wheel_metadata(url: str) -> str:
    """A remote wheel's METADATA: the index's PEP 658 file when it has one, else read out of the wheel's zip
    through HTTP Range requests (a few hundred KiB, not the wheel)."""
    try:
        return _get(url + ".metadata").decode()
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
    with zipfile.ZipFile(_RemoteFile(url)) as z:
        name = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


def torch_pin(metadata: str) -> str | None:
    """The `Requires-Dist: torch==X` of a wheel's METADATA (no extra marker), or None."""
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if canonicalize_name(req.name) == "torch" and (req.marker is None or "extra" not in str(req.marker)):
                pins = [s.version for s in req.specifier if s.operator == "=="]
                return pins[0] if pins else None
    return None


def choose_vllm(torch: str, index: str, wheel_tag: str, only: str | None) -> tuple[str, str, str]:
    """(version, wheel url, metadata text) of the newest vLLM release whose x86-64 wheel pins torch==`torch`
    (or of `only`, which must pin it). Reads each candidate's METADATA (PEP 658 `<wheel url>.metadata`)."""
    listing = json.loads(_get(f"{index.rstrip('/')}/vllm/", "application/vnd.pypi.simple.v1+json"))
    by_version: dict[Version, dict] = {}
    for f in listing["files"]:
        m = re.match(r"vllm-([^-]+)-.*\.whl$", f["filename"])
        if m and wheel_tag in f["filename"] and not f.get("yanked"):
            by_version[Version(m.group(1))] = f
    want = Version(torch)
    candidates = sorted((v for v in by_version if not v.is_prerelease), reverse=True)
    if only:
        candidates = [Version(only)]
        if candidates[0] not in by_version:
            raise SystemExit(f"gpu_bundle: no vllm {only} wheel with {wheel_tag} on {index}")
    for v in candidates:
        f = by_version[v]
        meta = wheel_metadata(f["url"])
        pin = torch_pin(meta)
        say(f"vllm {v}: pins torch=={pin}")
        if pin and Version(pin) == want:
            return str(v), f["url"], meta
        if only:
            raise SystemExit(f"gpu_bundle: vllm {only} pins torch=={pin}, not {torch}: drop --vllm to choose by pin")
        if pin and Version(pin) < want:
            break  # older releases pin older torches
    raise SystemExit(f"gpu_bundle: no vllm release on {index} pins torch=={torch}")


def download(reqs: list[str], cache: Path, plat: list[str]) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    missing = [r for r in reqs if not _cached(cache, r)]
    binary = [r for r in missing if canonicalize_name(r.split("==")[0]) not in SDIST_ONLY]
    if binary:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-qq", "--no-deps", *plat, "-d", str(cache), *binary], check=True
        )
    for r in missing:
        if canonicalize_name(r.split("==")[0]) in SDIST_ONLY:
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-qq", "--no-deps", "-w", str(cache), r], check=True)
    still = [r for r in reqs if not _cached(cache, r)]
    if still:
        raise SystemExit(f"gpu_bundle: not downloaded: {still}")


def _wheel_key(filename: str) -> tuple[str, str]:
    name, version = filename.split("-")[:2]
    return canonicalize_name(name), str(Version(version))


def _cached(cache: Path, req: str) -> Path | None:
    name, version = req.split("==")
    key = (canonicalize_name(name), str(Version(version)))
    return next((p for p in cache.glob("*.whl") if _wheel_key(p.name) == key), None)


def strip(site: Path) -> list[str]:
    removed = []
    for pattern in STRIP:
        for path in sorted(site.glob(pattern.rstrip("/"))):
            if path.name.startswith("_C.cpython-312"):
                continue
            removed.append(path.relative_to(site).as_posix())
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return removed


def installed(site: Path) -> dict[str, tuple[str, Path]]:
    """canonical name -> (version, dist-info METADATA path) of every distribution in the tree."""
    out = {}
    for meta in site.glob("*.dist-info/METADATA"):
        text = meta.read_text(errors="replace")
        name = re.search(r"^Name: (.+)$", text, re.M).group(1).strip()
        version = re.search(r"^Version: (.+)$", text, re.M).group(1).strip()
        out[canonicalize_name(name)] = (version, meta)
    return out


def check_requirements(dists: dict[str, tuple[str, Path]], python: str) -> list[str]:
    """Every Requires-Dist (markers for Linux x86-64 and `python`, no extras) of the tree's distributions
    must be met: by the tree at a matching version, by the image (name only), or be in LEFT_OUT. Returns
    the requirements expected from the image."""
    env = default_environment()
    env.update(
        python_version=python,
        python_full_version=f"{python}.0",
        platform_machine="x86_64",
        sys_platform="linux",
        platform_system="Linux",
        os_name="posix",
        extra="",
    )
    problems, from_image = [], set()
    for name, (_, meta) in sorted(dists.items()):
        for line in meta.read_text(errors="replace").splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = canonicalize_name(req.name)
            if dep in LEFT_OUT:
                continue
            if dep in dists:
                if not req.specifier.contains(dists[dep][0], prereleases=True):
                    problems.append(f"{name} needs {req}, the bundle has {dep} {dists[dep][0]}")
            elif dep in IMAGE:
                from_image.add(f"{dep}{req.specifier}")
            else:
                problems.append(f"{name} needs {req}: not in the bundle, not on the image, not in LEFT_OUT")
    if problems:
        raise SystemExit("gpu_bundle: unmet requirements:\n  " + "\n  ".join(problems))
    return sorted(from_image)


def repo_bytes(repo: Path) -> int:
    """Bytes of what travels with every transfer: tracked files plus untracked files git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return sum((repo / f).stat().st_size for f in out.split("\0") if f and (repo / f).is_file())


def build_addon(name: str, out: Path, cache: Path, level: str, repo: Path) -> dict:
    """The add-on `name` (ADDONS) from the cached wheel of the vLLM that out/manifest.json names, into `out`
    beside the parts (which stay as they are). Returns its manifest entry."""
    if name not in ADDONS:
        raise SystemExit(f"gpu_bundle: --addon {name}: unknown add-on (known: {', '.join(sorted(ADDONS))})")
    manifest_path = out / vime_bundle.MANIFEST
    if not manifest_path.is_file():
        raise SystemExit(f"gpu_bundle: --addon needs {manifest_path}: build the bundle first (without --addon)")
    manifest = json.loads(manifest_path.read_text())
    version = manifest["versions"]["vllm"]
    wheel = _cached(cache / "wheels", f"vllm=={version}")
    if wheel is None:
        raise SystemExit(
            f"gpu_bundle: --addon {name}: no vllm {version} wheel in {cache / 'wheels'}: pass --cache with the "
            f"build's cache (or rebuild the bundle, which downloads it)"
        )
    files = {}
    with zipfile.ZipFile(wheel) as z:
        for rel in ADDONS[name]:
            if rel not in manifest.get("stripped", []):
                raise SystemExit(f"gpu_bundle: --addon {name}: {rel} is in the main archive already (not stripped)")
            files[rel] = z.read(rel)
    say(f"add-on {name}: {', '.join(f'{r} ({len(d) / MIB:.1f} MiB)' for r, d in files.items())} from {wheel.name}")
    with tempfile.TemporaryDirectory(prefix="gpu_bundle.addon.") as tmp:
        entry = vime_bundle.pack_addon(name, files, out, level=level, work=Path(tmp))
    total = entry["size"] + repo_bytes(repo) + manifest_path.stat().st_size
    say(
        f"add-on {name}: {out}/{entry['name']} {entry['size'] / MIB:.2f} MiB, sha256 {entry['sha256']} "
        f"(+ repository + manifest = {total / MIB:.2f} MiB in its transfer); parts unchanged"
    )
    if total > 64 * MIB:
        raise SystemExit(f"gpu_bundle: add-on {name} with the repository is {total / MIB:.1f} MiB, over 64 MiB")
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch", default="2.11.0", help="the GPU image's torch (vLLM is chosen by its pin)")
    ap.add_argument("--python", default="3.12", help="the GPU image's Python (major.minor)")
    ap.add_argument("--platform", default="manylinux_2_28_x86_64", help="the vLLM wheel's platform tag")
    ap.add_argument("--glibc", default="2.35", help="the newest manylinux glibc the dependencies' wheels may need")
    ap.add_argument("--vllm", default=None, help="this vLLM release (must pin --torch) instead of the newest that does")
    ap.add_argument("--index", default="https://pypi.org/simple", help="PEP 691 index to read vLLM's releases from")
    ap.add_argument("--out", type=Path, default=Path(".bundle"))
    ap.add_argument("--cache", type=Path, default=Path(".bundle-cache"), help="downloaded wheels (kept)")
    ap.add_argument(
        "--part-mib",
        type=float,
        default=None,
        help="part size in MiB (default: 62 MiB minus the repository minus 64 KiB for the manifest)",
    )
    ap.add_argument("--xz", default="9e", help="xz preset (default 9e)")
    ap.add_argument(
        "--xz-dict-mib",
        type=int,
        default=256,
        help="xz dictionary in MiB (default 256: matches across Ray's binaries; unpacking needs as much)",
    )
    ap.add_argument(
        "--xz-threads",
        type=int,
        default=1,
        help="xz threads (default 1: one block, smallest; more: faster, a little larger)",
    )
    ap.add_argument(
        "--addon",
        choices=sorted(ADDONS),
        default=None,
        help="build only this optional add-on from the cached vLLM wheel, beside the existing parts (no network)",
    )
    args = ap.parse_args(argv)
    repo = Path(__file__).resolve().parent.parent
    if args.addon:
        build_addon(args.addon, args.out, args.cache, args.xz, repo)
        return 0

    version, url, meta = choose_vllm(args.torch, args.index, args.platform, args.vllm)
    say(f"vllm {version} pins torch=={args.torch}: {url.rsplit('/', 1)[1]}")
    # the dependencies' wheels: any manylinux up to glibc --glibc (the image's is newer than 2.35)
    glibc = int(args.glibc.split(".")[1])
    plats = (
        [args.platform]
        + [f"manylinux_2_{m}_x86_64" for m in range(glibc, 4, -1)]
        + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    )
    plat = platform_args(args.python, plats)
    wheels = args.cache / "wheels"
    download([f"vllm=={version}"] + [f"{n}=={v}" for n, v in sorted(PINS.items())], wheels, plat)

    with tempfile.TemporaryDirectory(prefix="gpu_bundle.") as tmp:
        site = Path(tmp) / "site"
        files = [str(_cached(wheels, f"vllm=={version}"))] + [
            str(_cached(wheels, f"{n}=={v}")) for n, v in sorted(PINS.items())
        ]
        say(f"installing {len(files)} wheels into a site tree")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-qq",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-warn-script-location",
                "--ignore-requires-python",
                "--target",
                str(site),
                *plat,
                *files,
            ],
            check=True,
        )
        removed = strip(site)
        say(f"stripped {len(removed)} paths: {', '.join(removed)}")
        for rel in MUST_HAVE:
            if not (site / rel).exists():
                raise SystemExit(f"gpu_bundle: {rel} is missing from the tree")
        for top in MUST_NOT_HAVE:
            if (site / top).exists() or list(site.glob(f"{top}-*.dist-info")):
                raise SystemExit(f"gpu_bundle: {top} must not be in the bundle")
        dists = installed(site)
        from_image = check_requirements(dists, args.python)
        tree = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
        say(
            f"{len(dists)} distributions, {tree / MIB:.0f} MiB installed; every requirement met "
            f"({len(from_image)} by the image)"
        )

        repo_size = repo_bytes(repo)
        part = int(args.part_mib * MIB) if args.part_mib else 62 * MIB - repo_size - 64 * 1024
        pin = torch_pin(meta)
        versions = {"torch_pin": pin, **{n: v for n, (v, _) in sorted(dists.items())}}
        extra = {
            "target": {"python": args.python, "platform": args.platform, "torch": args.torch},
            "stripped": removed,
            "expects_on_image": from_image,
            "left_out": {k: v for k, v in sorted(LEFT_OUT.items())},
        }
        say(
            f"compressing (tar | xz -{args.xz}, dictionary {args.xz_dict_mib} MiB, {args.xz_threads} thread(s)); "
            f"parts of at most {part / MIB:.2f} MiB"
        )
        manifest = vime_bundle.pack(
            site,
            args.out,
            part,
            versions,
            extra,
            level=args.xz,
            work=Path(tmp),
            dict_mib=args.xz_dict_mib,
            threads=args.xz_threads,
        )

    whole = manifest["archive"]["size"]
    say(f"archive {whole / MIB:.1f} MiB, sha256 {manifest['archive']['sha256']}")
    for p in manifest["parts"]:
        total = p["size"] + repo_size + (args.out / vime_bundle.MANIFEST).stat().st_size
        say(
            f"  {args.out}/{p['name']}: {p['size'] / MIB:.2f} MiB (+ repository {repo_size / MIB:.2f} MiB + "
            f"manifest = {total / MIB:.2f} MiB per transfer)"
        )
    say(
        f"{len(manifest['parts'])} part(s); versions: vllm {versions['vllm']} (torch=={pin}), ray {versions['ray']}, "
        f"megatron-core {versions['megatron-core']}, hydra-core {versions['hydra-core']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
