# Baton's serving image (router, prefill and decode nodes): the image that deploy/helm/baton's values.yaml names.
#   docker build -t <your-registry>/baton-serve:0.1.0 .     (the tag is the chart's appVersion)
# The base is named without a registry host: the builder's default registry resolves it.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS base
# gcc and the Python headers stay in the image because Triton compiles its kernel launchers at run time.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM base AS build
COPY . /src
# The same script and pins as tests/test_container_install.py and `make venv` (deploy/requirements/pins.env).
RUN PIP_NO_CACHE_DIR=1 bash /src/deploy/docker/install.sh /opt/venv /src cuda

FROM base
COPY --from=build /opt/venv /opt/venv
# The chart runs pods as uid/gid 1000; Ubuntu's images give that uid to a user "ubuntu", replaced by "baton".
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && groupadd --gid 1000 baton \
    && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin baton
# The chart's pods run `python -m baton.<role>.server`, so the venv's python comes first on PATH.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
# Numeric, so that a runAsNonRoot pod can verify it without a runAsUser of its own.
USER 1000:1000
WORKDIR /home/baton
ENTRYPOINT ["baton"]
CMD ["--help"]
