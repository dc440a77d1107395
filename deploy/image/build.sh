#!/usr/bin/env bash
# Builds Scepsy's two container images from the repository root's Dockerfile:
#
#   scepsy-proxy:<version>      target `proxy`: the sidecar/gateway proxy, the base install only
#                               (aiohttp, orjson, duckdb, numpy, prometheus-client, PyYAML,
#                               uvloop, multidict and their dependencies)
#   scepsy-optimizer:<version>  target `optimizer`: `scepsy` (daemon, render, ...) with the
#                               optimizer extra, and `scepsy-engine` (the emulator)
#
# <version> is pyproject's; both run as uid 65532 on Debian bookworm's python3 (3.11).
# Measured 2026-12-05 on a 2-core sandbox (docker.io 20.10, legacy builder): scepsy-proxy:0.1.0
# 303 MB, scepsy-optimizer:0.1.0 455 MB (base 125 MB); a full run (wheels, debootstrap, both
# images, nothing cached) 1m44s.
#
# No registry is needed, so it works offline and on air-gapped build hosts:
#   1. the Python packages are wheels built here (`pip wheel`, from the package index pip is
#      configured with, or its cache) into build/wheels, pinned by deploy/image/constraints.txt,
#      and installed in the image with `pip install --no-index --no-deps` (then `pip check`);
#      the host's python must be 3.11 on the image's architecture (the wheels are cp311);
#   2. the base image is not pulled: `debootstrap --variant=minbase bookworm` makes a Debian
#      root file system (from the apt mirror in $DEBIAN_MIRROR) with python3 and python3-venv,
#      and `docker import` turns it into scepsy-base:bookworm. Needs root (debootstrap) and
#      `apt-get install debootstrap docker.io`.
#
# Usage (from anywhere):
#   deploy/image/build.sh                 # wheels, base image, both images
#   deploy/image/build.sh wheels          # only build/wheels
#   deploy/image/build.sh constraints     # re-pin constraints.txt from .venv/bin/pip freeze
#   REGISTRY=registry.example.com/scepsy deploy/image/build.sh   # also tag REGISTRY/<image>
# The base image is made once and reused; `docker rmi scepsy-base:bookworm` has it made again.
# Where no docker engine answers, it builds the wheels and stops with a message (exit 3).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
VERSION=$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
CONSTRAINTS=deploy/image/constraints.txt
WHEELS=build/wheels
BASE=scepsy-base:bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

constraints() {
    # The dependency closure of pyproject's base dependencies (tagged "# proxy") and of the
    # optimizer extra (tagged "# optimizer"), at the versions pip freeze reports in the venv.
    "$ROOT/.venv/bin/pip" freeze --exclude-editable > build/freeze.txt
    "$PYTHON" - build/freeze.txt > "$CONSTRAINTS" <<'PY'
import re
import sys
import tomllib
from importlib import metadata

from packaging.requirements import Requirement

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
frozen = {}
for line in open(sys.argv[1]):
    name, sep, version = line.strip().partition("==")
    if sep:
        frozen[re.sub(r"[-_.]+", "-", name).lower()] = (name, version)


def closure(requirements):
    found, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if (req.marker and not req.marker.evaluate({"extra": ""})) or key in found:
            continue
        if key == "scepsy":
            todo += [Requirement(r) for e in req.extras
                     for r in project["optional-dependencies"][e]]
            continue
        found.add(key)
        todo += [Requirement(r) for r in metadata.distribution(req.name).requires or []]
    return found


proxy = closure(project["dependencies"])
optimizer = closure(project["optional-dependencies"]["optimizer"]) - proxy
print("# Exact pins of the images' Python packages, from .venv/bin/pip freeze")
print("# (deploy/image/build.sh constraints rewrites this file). `# proxy`: the base install's")
print("# closure, in both images; `# optimizer`: the optimizer extra's, in scepsy-optimizer only.")
for tag, keys in (("proxy", proxy), ("optimizer", optimizer)):
    for key in sorted(keys):
        name, version = frozen[key]
        print(f"{name}=={version}  # {tag}")
PY
    echo "wrote $CONSTRAINTS"
}

wheels() {
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    sed 's/ *#.*//; /^$/d' "$CONSTRAINTS" > build/pins.txt
    "$PYTHON" -m pip wheel --no-deps --wheel-dir "$WHEELS" -r build/pins.txt
    "$PYTHON" -m pip wheel --no-deps --wheel-dir "$WHEELS" .
    echo "wheels in $WHEELS: $(ls "$WHEELS" | wc -l) files"
}

base_image() {
    if docker image inspect "$BASE" > /dev/null 2>&1; then
        return
    fi
    command -v debootstrap > /dev/null || { echo "build.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 3; }
    local dir
    dir=$(mktemp -d)
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$dir" "$DEBIAN_MIRROR"
    # No apt caches, manuals or translations in the image (about 50 MB); the packages'
    # copyright files stay.
    rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/cache/apt/*.bin \
        "$dir"/var/lib/apt/lists/* "$dir"/usr/share/man/* "$dir"/usr/share/info/* \
        "$dir"/usr/share/locale/*
    find "$dir"/usr/share/doc -mindepth 1 -not -type d -not -name copyright -delete
    find "$dir"/usr/share/doc -mindepth 1 -type d -empty -delete
    tar -C "$dir" -c . | docker import - "$BASE"
    rm -rf "$dir"
}

mkdir -p build
case "${1:-all}" in
    constraints) constraints; exit 0 ;;
    wheels) wheels; exit 0 ;;
    all) ;;
    *) echo "usage: $0 [all|wheels|constraints]" >&2; exit 2 ;;
esac

wheels
if ! command -v docker > /dev/null || ! docker info > /dev/null 2>&1; then
    echo "build.sh: no docker engine answers here; the wheels are in $WHEELS, no image was" \
         "built. Run it where docker runs (it needs no registry)." >&2
    exit 3
fi
base_image
for target in proxy optimizer; do
    # --network host: the RUN steps download nothing and so need no bridge network.
    docker build --network host --target "$target" --build-arg BASE="$BASE" \
        --tag "scepsy-$target:$VERSION" .
    if [ -n "${REGISTRY:-}" ]; then
        docker tag "scepsy-$target:$VERSION" "$REGISTRY/scepsy-$target:$VERSION"
    fi
done
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "^scepsy-(proxy|optimizer):$VERSION "
