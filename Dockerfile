# GPU image: Ray 2.60 on Python 3.11 with CUDA, this project and the CUDA build of vLLM.
# The same image serves as RayService head and GPU worker on Kubernetes, or alone:
#   docker run --gpus all -p 8000:8000 -v hf-cache:/models IMAGE serve run deploy/config.single-gpu.yaml
# (It cannot be built on the CPU-only development machines of this project.)
FROM rayproject/ray:2.60.0-py311-gpu

# Model weights: the Hugging Face cache lives on a volume (a PVC on Kubernetes, mounted
# at /models), so a restarted pod does not download 19 GB again. HF_TOKEN, if needed,
# comes from a Secret.
USER root
RUN mkdir -p /models/hf && chown -R 1000:100 /models
ENV HF_HOME=/models/hf

# The base image's user `ray` (uid 1000, group users) owns the Python environment;
# everything below, and the container at run time, is non-root.
USER 1000:100
WORKDIR /home/ray/app

# Dependencies first, each pinned and checked against its hash (requirements/gpu.lock, written by
# `make lock` from pyproject.toml); then this project alone, with nothing left to resolve.
COPY --chown=1000:100 requirements/gpu.lock ./requirements/
RUN pip install --no-cache-dir --require-hashes -r requirements/gpu.lock
COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 serve_app ./serve_app
COPY --chown=1000:100 deploy ./deploy
RUN pip install --no-cache-dir --no-deps --no-build-isolation .

VOLUME ["/models"]

# 8000: Serve HTTP; 9000: Serve gRPC; 8265: Ray dashboard; 6379: Ray GCS; 8080: Prometheus metrics.
EXPOSE 8000 9000 8265 6379 8080
CMD ["serve", "run", "deploy/config.single-gpu.yaml"]
