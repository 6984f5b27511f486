# Conveyor's container image: the broker by default (`python -m conveyor`), any `conveyor` command by
# overriding the command (`run examples.handlers`, `publish ...`). docs/operations.md, "Deploy: container
# and compose", describes the options; `make image` builds it with podman (deploy/podman/).
#
# Stage 1 builds the same wheel `pip install .` would; stage 2 installs only that wheel, its dependencies
# and the `cluster` extra (--cluster needs it) into a venv, so the runtime image has no source tree, compiler or build tools.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY conveyor ./conveyor
COPY broker ./broker
COPY consumers ./consumers
COPY decorators ./decorators
COPY monitoring ./monitoring
COPY pipeline ./pipeline
COPY benchmarks ./benchmarks
# A build behind a TLS-inspecting proxy may pass its CA bundle as the optional secret `pip_ca`
# (`--secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt`); without it pip uses its own bundle.
RUN --mount=type=secret,id=pip_ca,required=false \
    if [ -s /run/secrets/pip_ca ]; then export PIP_CERT=/run/secrets/pip_ca; fi; \
    python -m venv /opt/conveyor \
    && /opt/conveyor/bin/pip install --no-cache-dir --disable-pip-version-check --quiet build \
    && /opt/conveyor/bin/python -m build --wheel --outdir /dist . \
    && python -m venv /opt/conveyor-runtime \
    && wheel=$(ls /dist/conveyor-*.whl) \
    && /opt/conveyor-runtime/bin/pip install --no-cache-dir --disable-pip-version-check --quiet "$wheel[cluster]"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="conveyor" \
      org.opencontainers.image.description="Conveyor message broker" \
      org.opencontainers.image.licenses="Apache-2.0"
# The venv keeps the path it was created at: copy it to the same place.
COPY --from=build /opt/conveyor-runtime /opt/conveyor-runtime
RUN groupadd --system --gid 10001 conveyor \
    && useradd --system --uid 10001 --gid conveyor --home-dir /var/lib/conveyor --shell /usr/sbin/nologin conveyor \
    && mkdir -p /var/lib/conveyor/data /app \
    && chown -R conveyor:conveyor /var/lib/conveyor
# Every option is a CONVEYOR_* variable (docs/operations.md): CONVEYOR_BROKER_<OPTION> for the broker,
# CONVEYOR_RUN_<OPTION> for `run`, CONVEYOR_<OPTION> for every command. A container listens on all its
# interfaces (its 127.0.0.1 is reachable from nowhere else); the ports stay the defaults, 5555 and 9100.
ENV PATH=/opt/conveyor-runtime/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    CONVEYOR_BROKER_BIND=tcp://0.0.0.0:5555 \
    CONVEYOR_BROKER_DATA_DIR=/var/lib/conveyor/data \
    CONVEYOR_METRICS_BIND=0.0.0.0
# `conveyor run MODULE` imports MODULE from the working directory: mount your handlers under /app.
WORKDIR /app
VOLUME ["/var/lib/conveyor/data"]
EXPOSE 5555 9100
USER conveyor:conveyor
# Liveness only (docs/monitoring.md): /livez fails only when this process's loop is wedged, never for
# another node's trouble, a full disk or a missing upstream. Reads the port the broker was given.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD python -c "import os, urllib.request; port = os.environ.get('CONVEYOR_BROKER_METRICS_PORT') or os.environ.get('CONVEYOR_METRICS_PORT', '9100'); urllib.request.urlopen(f'http://127.0.0.1:{port}/livez', timeout=4)"
ENTRYPOINT ["python", "-m", "conveyor"]
CMD []
