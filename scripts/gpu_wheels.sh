#!/usr/bin/env bash
# Wheels that `python -m vime.train` needs on the H200 image (torch 2.11, Python 3.12, x86-64, no internet;
# no Ray, Hydra, omegaconf, antlr4, jsonschema, W&B, megatron-core there), into the ignored folder .whl/.
# Run it here (with internet), then carry .whl/ with the repository; scripts/gpu_train.sh installs them there.
#
#   bash scripts/gpu_wheels.sh          # prints what it fetched and the total; fails if it is over the budget
#
# Versions: those of constraints.txt (the CPU venv), except megatron-core (0.19.2: the version run on the H200).
# Ray's cp312 wheel (~79 MB) is repacked without ray/jars/ (Java workers, 31 MB) and the dashboard's web client
# build (ray/dashboard/client/build): Python workers and `ray.init(include_dashboard=False)` use neither. The
# repacked wheel keeps its name, its files' permissions and a RECORD that lists exactly what it holds.
# W&B (wandb 0.31: 20 MB + pydantic, sentry-sdk, gitpython, ...) does not fit beside Ray: the GPU preset runs
# with wandb.mode=disabled (metrics.jsonl and the console table still record every step).
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=.whl
BUDGET_MIB=${BUDGET_MIB:-60}   # .whl/ plus the repository must stay under the 64 MiB carry limit
PY=${PYTHON:-python3}
mkdir -p "$WHL"
pin() { grep -i "^$1==" constraints.txt | head -1 | cut -d= -f3; }
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
fetch() {  # fetch NAME==VERSION: a cp312 / py3 binary wheel, unless one of that name and version is there already
  local name=${1%%==*} version=${1##*==} norm
  norm=$(echo "$name" | tr '-' '_')
  if compgen -G "$WHL/${norm}-${version}-*.whl" > /dev/null; then return; fi
  $PY -m pip download -q --no-deps "${PLAT[@]}" -d "$WHL" "$1"
}

fetch "megatron-core==${MEGATRON_VERSION:-0.19.2}"
for p in ray hydra-core omegaconf jsonschema jsonschema-specifications referencing rpds-py; do
  v=$(pin "$p"); [ -n "$v" ] || { echo "gpu_wheels: $p is not pinned in constraints.txt" >&2; exit 1; }
  fetch "$p==$v"
done
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 / hydra 1.3 need) exists only as an sdist: build its
# pure-Python wheel here.
ANTLR=$(pin antlr4-python3-runtime)
if ! compgen -G "$WHL/antlr4_python3_runtime-${ANTLR}-*.whl" > /dev/null; then
  $PY -m pip wheel -q --no-deps -w "$WHL" "antlr4-python3-runtime==$ANTLR"
fi

# Repack Ray: drop the Java jars and the dashboard client build, rewrite RECORD (idempotent).
$PY - "$WHL" <<'EOF'
import base64, hashlib, sys, zipfile
from pathlib import Path

DROP = ("ray/jars/", "ray/dashboard/client/build/")
(wheel,) = sorted(Path(sys.argv[1]).glob("ray-*-cp312-*.whl"))
with zipfile.ZipFile(wheel) as z:
    infos = z.infolist()
    if not any(i.filename.startswith(DROP) for i in infos):
        print(f"{wheel.name}: already repacked")
        sys.exit(0)
    record_name = next(i.filename for i in infos if i.filename.count("/") == 1  # the wheel's own, not a vendored one
                       and i.filename.startswith("ray-") and i.filename.endswith(".dist-info/RECORD"))
    keep = [i for i in infos if not i.filename.startswith(DROP)]
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as out:
        rows = []
        for i in keep:
            if i.filename == record_name:
                continue
            data = z.read(i)
            out.writestr(i, data, compress_type=zipfile.ZIP_DEFLATED)  # ZipInfo keeps permissions (raylet, gcs_server)
            if not i.is_dir():
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                rows.append(f"{i.filename},sha256={digest},{len(data)}")
        rows.append(f"{record_name},,")
        info = next(i for i in infos if i.filename == record_name)
        out.writestr(info, "\n".join(rows) + "\n", compress_type=zipfile.ZIP_DEFLATED)
dropped = len(infos) - len(keep)
tmp.replace(wheel)
print(f"{wheel.name}: repacked without {', '.join(DROP)} ({dropped} files dropped), "
      f"{wheel.stat().st_size / 2**20:.1f} MiB")
EOF

# Check the repacked wheel: a valid zip whose RECORD lists exactly its files with their sha256; then install the
# whole set the way scripts/gpu_train.sh does (a Python 3.12 when there is one: VERIFY_PYTHON, python3.12).
$PY - "$WHL" <<'EOF'
import base64, csv, hashlib, io, sys, zipfile
from pathlib import Path

(wheel,) = sorted(Path(sys.argv[1]).glob("ray-*-cp312-*.whl"))
with zipfile.ZipFile(wheel) as z:
    assert z.testzip() is None, f"{wheel.name}: corrupt member {z.testzip()}"
    names = {i.filename for i in z.infolist() if not i.is_dir()}
    record = next(n for n in names if n.count("/") == 1 and n.startswith("ray-") and n.endswith(".dist-info/RECORD"))
    vendored = [n for n in names if n.endswith(".dist-info/RECORD") and n != record]
    assert all(len(z.read(n)) < 100_000 for n in vendored), "a vendored RECORD was rewritten"
    rows = list(csv.reader(io.StringIO(z.read(record).decode())))
    listed = {r[0] for r in rows if r}
    assert listed == names, f"RECORD and zip differ: {sorted(listed ^ names)[:5]}"
    for name, digest, _size in (r for r in rows if r and r[1]):
        h = base64.urlsafe_b64encode(hashlib.sha256(z.read(name)).digest()).rstrip(b"=").decode()
        assert digest == f"sha256={h}", f"{name}: hash differs from RECORD"
    assert not any(n.startswith(("ray/jars/", "ray/dashboard/client/build/")) for n in names)
    for exe in ("ray/core/src/ray/raylet/raylet", "ray/core/src/ray/gcs/gcs_server"):
        assert (z.getinfo(exe).external_attr >> 16) & 0o111, f"{exe} lost its executable bit"
print(f"{wheel.name}: zip and RECORD consistent ({len(names)} files), executables kept")
EOF
VPY=${VERIFY_PYTHON:-$(command -v python3.12 || true)}
if [ -n "$VPY" ] && "$VPY" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  SITE=$(mktemp -d /tmp/gpu_wheels_site.XXXXXX)
  "$VPY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl
  test -x "$SITE/ray/core/src/ray/raylet/raylet" && test -f "$SITE/ray/_raylet.so" && test -d "$SITE/hydra" \
    && test -d "$SITE/omegaconf" && test -d "$SITE/megatron/core"
  # `import ray` needs the image's click, msgpack, protobuf, ...: tried only where this Python has them
  if PYTHONPATH="$SITE" "$VPY" -c 'import ray, hydra, omegaconf, jsonschema' 2>/dev/null; then
    echo "gpu_wheels: installed with $("$VPY" -V) into $SITE; import ray, hydra, omegaconf, jsonschema: ok"
  else
    echo "gpu_wheels: installed with $("$VPY" -V) into $SITE (import not tried: this Python lacks Ray's deps)"
  fi
  rm -rf "$SITE"
else
  echo "gpu_wheels: no Python 3.12 here (VERIFY_PYTHON=...): install not tried"
fi

ls -l "$WHL"
total=$(du -cb "$WHL"/*.whl | tail -1 | cut -f1)
repo=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
$PY - "$total" "$repo" "$BUDGET_MIB" <<'EOF'
import sys
whl, repo, budget = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
mib = lambda n: n / 2**20  # noqa: E731
print(f"gpu_wheels: .whl/ {mib(whl):.1f} MiB + repository {mib(repo):.1f} MiB = {mib(whl + repo):.1f} MiB "
      f"(budget {budget} MiB)")
if whl + repo > budget * 2**20:
    sys.exit(f"gpu_wheels: over the {budget} MiB budget")
EOF
