# The tgp image: `tgp worker` and `tgp bridge` (deploy/kustomize/), `tgp codec-server`.
#   docker build -t <your-registry>/tgp:0.2.0 . && docker push <your-registry>/tgp:0.2.0
#   docker run --rm <your-registry>/tgp:0.2.0 rollout build-id   # its build, for Worker Versioning
# then set that reference in your overlay's `images:` (docs/install.md).
# tests/test_deploy.py lints this file (hadolint) and builds and imports what it installs.

# Build stage: tgp and its runtime dependencies (no dev extras) in a virtualenv.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tgp ./tgp
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
COPY crd_bridge ./crd_bridge
RUN python -m venv /opt/tgp && /opt/tgp/bin/pip install .

# Runtime stage: the virtualenv alone, run as an unprivileged user.
FROM python:3.11-slim
# The build its workers poll as with Worker Versioning (docs/workflow-versioning.md). Empty: the
# package version and a hash of the workflow source, computed from the installed files, which
# `tgp rollout build-id` prints in the checkout too. Pin another with
#   docker build --build-arg TGP_BUILD_ID=0.2.0-<git sha> ...
# only if every change of workflows/ or tgp/ gets a new one: two codes under one build id break
# the runs pinned to it.
ARG TGP_BUILD_ID=""
ENV PATH=/opt/tgp/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TGP_BUILD_ID=$TGP_BUILD_ID
RUN groupadd --system --gid 10001 tgp \
    && useradd --system --uid 10001 --gid tgp --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin tgp
COPY --from=build /opt/tgp /opt/tgp
# Numeric, so the kubelet can check runAsNonRoot without reading /etc/passwd.
USER 10001:10001
ENTRYPOINT ["tgp"]
CMD ["--help"]
