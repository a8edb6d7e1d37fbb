# The rlbus image: every role runs from it (`rlbus ROLE @ config.toml ...`). Same install steps as .ci/run.
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*

WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
RUN pip install torch==2.13.0
COPY pyproject.toml README.md ./
COPY bus ./bus
COPY workers ./workers
COPY trainer ./trainer
COPY configs ./configs
RUN pip install -e '.[dev]'

ENTRYPOINT ["rlbus"]
CMD ["--help"]
