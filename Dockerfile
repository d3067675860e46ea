# kvblend image: the official vLLM 0.33 image (CUDA, PyTorch, vLLM) plus kvblend and the Ray
# version kvblend pins. Every pod of the Helm chart (helm/kvblend) runs this one image, so the
# Ray and Python versions of the Ray head, the cache shards and the vLLM replicas match.
#
#   docker build -t <registry>/kvblend:0.1.0 .
#
# The CUDA build of torch and vLLM that the base image ships is kept: the install below is
# constrained to the installed torch and vllm versions, so pip can never replace them.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
FROM ${VLLM_IMAGE}

# Must equal the ray pin in pyproject.toml (tests/helm checks it).
ARG RAY_VERSION=2.60.0

WORKDIR /opt/kvblend
COPY pyproject.toml README.md ./
COPY tiers ./tiers
COPY blend ./blend
COPY cluster ./cluster

RUN python3 -c "import torch, vllm; print(f'torch=={torch.__version__}'); print(f'vllm=={vllm.__version__}')" \
        > /tmp/keep-base.txt \
    && python3 -m pip install --no-cache-dir -c /tmp/keep-base.txt \
        "ray[default]==${RAY_VERSION}" . \
    && rm /tmp/keep-base.txt \
    && python3 -c "import ray, cluster, blend, tiers; assert ray.__version__ == '${RAY_VERSION}', ray.__version__"

# The chart runs every container as this non-root user (runAsNonRoot, uid 1000).
# (Ubuntu 24.04 bases already hold an `ubuntu` user with uid 1000: it is replaced.)
RUN if getent passwd 1000 >/dev/null; then userdel --remove "$(getent passwd 1000 | cut -d: -f1)"; fi \
    && if getent group 1000 >/dev/null; then groupdel "$(getent group 1000 | cut -d: -f1)"; fi \
    && useradd --uid 1000 --user-group --create-home --shell /bin/bash kvblend \
    && mkdir -p /var/lib/kvblend/disk /home/kvblend/.cache \
    && chown -R 1000:1000 /var/lib/kvblend /home/kvblend
USER 1000:1000
ENV HOME=/home/kvblend
WORKDIR /home/kvblend

# The base image's entrypoint is `vllm serve`; the chart gives each container its command.
ENTRYPOINT []
CMD ["kvblend", "--help"]
