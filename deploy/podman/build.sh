#!/usr/bin/env bash
# Build rlbus:latest with podman on the local base image from setup.sh, using this machine's pip configuration.
#
#   bash deploy/podman/build.sh            # after setup.sh; re-run after code changes (unchanged layers are cached)
#
# pip inside the build sees what `pip config list` shows here, read-only and only while building: one
# generated pip.conf (the config files' and PIP_* variables' settings merged), plus build-time volumes
# (podman build -v) for every local path those settings name: wheel folders (find-links), file:// indexes
# (their parent folder: index pages link ../../files/...), the constraints file and the CA bundle (PyPI may sit
# behind a TLS proxy whose CA only this machine trusts). So `pip install torch==2.13.0` takes the local CPU wheel,
# as in .ci/run; nothing of that configuration stays in the image.
set -euo pipefail
cd "$(dirname "$0")/../.."

BASE_IMAGE=${RLBUS_BASE_IMAGE:-localhost/rlbus-base:bookworm}
IMAGE=${RLBUS_IMAGE:-rlbus:latest}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

podman image exists "$BASE_IMAGE" || { echo "build.sh: no $BASE_IMAGE; run deploy/podman/setup.sh first" >&2; exit 1; }

WORK=$(mktemp -d /var/tmp/rlbus-build.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# Prints podman build arguments (one per line) and writes $WORK/pip.conf.
mapfile -t PIP_ARGS < <("$PYTHON" - "$WORK/pip.conf" <<'EOF'
import os, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
settings = {}
for line in out.splitlines():                  # global.find-links='/opt/wheels'   :env:.cert='...'
    key, _, value = line.partition("=")
    section, _, name = key.rpartition(".")
    if name and section in ("global", ":env:", "install"):
        settings[name] = value.strip().strip("'\"")
mounts = {}  # path inside the build -> path here
for value in settings.values():
    for item in value.split():
        path = item[len("file://"):] if item.startswith("file://") else item
        if not path.startswith("/") or not os.path.exists(path):
            continue
        path = path.rstrip("/")
        if os.path.basename(path) == "simple":  # a PEP 503 index: its files lie beside it
            path = os.path.dirname(path)
        mounts[path] = os.path.realpath(path)
with open(sys.argv[1], "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(settings.items())))
print("-v"), print(f"{sys.argv[1]}:/etc/pip.conf:ro")
for inside, here in sorted(mounts.items()):
    print("-v"), print(f"{here}:{inside}:ro")
EOF
)

echo "[build] pip.conf for the build:"; sed 's/^/    /' "$WORK/pip.conf"
echo "[build] podman build --network host --build-arg BASE=$BASE_IMAGE ${PIP_ARGS[*]} -t $IMAGE ."
OLD=$(podman image inspect "$IMAGE" --format '{{.Id}}' 2>/dev/null || true)
t0=$SECONDS
podman build --network host --build-arg "BASE=$BASE_IMAGE" "${PIP_ARGS[@]}" -t "$IMAGE" -f Dockerfile .
echo "[build] $IMAGE built in $((SECONDS - t0))s ($(podman image inspect "$IMAGE" --format '{{.Size}}' | numfmt --to=iec))"
NEW=$(podman image inspect "$IMAGE" --format '{{.Id}}')
if [ -n "$OLD" ] && [ "$OLD" != "$NEW" ]; then  # the previous build, now untagged: 2 GB less on disk
    podman rmi "$OLD" >/dev/null 2>&1 && echo "[build] removed the previous image ${OLD:0:12}" || true
fi
