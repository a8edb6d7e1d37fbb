# The rlbus image: every role runs from it (`rlbus ROLE @ config.toml ...`), and so does its Redis
# (docker-compose.yml runs redis-server from this image: one image, nothing to pull). Same install steps as .ci/run.
#
#   docker build -t rlbus:latest .            # public path: python:3.11-slim from a registry
#   bash deploy/podman/setup.sh && bash deploy/podman/build.sh
#                                             # no registry: podman on a debootstrapped bookworm base
#                                             # (podman build --build-arg BASE=localhost/rlbus-base:bookworm, with
#                                             # this machine's pip config and wheel folders as read-only build volumes)
#
# BASE must be Debian bookworm-like with Python 3.11 (python:3.11-slim, or Debian's own python3 = 3.11.2).
# Python packages go into a venv (/opt/venv, first on PATH): it works the same on both bases, where Debian's
# own python3 would refuse a system-wide `pip install` (PEP 668) without --break-system-packages.
ARG BASE=python:3.11-slim
FROM ${BASE}

# redis-server (docker-compose.yml's redis runs from this image) and a C compiler (`.[dev]` pulls sdists such as
# pycosat): the local base has both (and python3-venv); python:3.11-slim gets them from apt.
RUN (command -v redis-server && command -v gcc) >/dev/null \
    || (apt-get update && apt-get install -y --no-install-recommends redis-server gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*)

ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv

WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
# pip reads its index/wheel configuration from the build environment: build-time volumes (podman build -v)
# with the machine's pip.conf and local wheel folders make torch come from the local CPU wheel; nothing of
# that configuration stays in the image.
RUN pip install torch==2.13.0
# The dependencies (`.[dev]`, ~2 min) in a layer that only pyproject.toml invalidates (empty package folders and a
# placeholder README stand in for the sources); then the project itself, editable, in seconds.
COPY pyproject.toml ./
RUN mkdir -p bus workers trainer && touch README.md && pip install -e '.[dev]'
COPY README.md ./
COPY bus ./bus
COPY workers ./workers
COPY trainer ./trainer
COPY configs ./configs
RUN pip install --no-deps -e .

ENTRYPOINT ["rlbus"]
CMD ["--help"]
