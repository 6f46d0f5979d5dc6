# GPU image: Ray 2.60 on Python 3.11 with CUDA, this project and the CUDA build of vLLM.
# The same image serves as RayService head and GPU worker on Kubernetes, or alone:
#   docker run --gpus all -p 8000:8000 -v hf-cache:/models IMAGE serve run deploy/config.yaml
# (It cannot be built on the CPU-only development machines of this project.)
FROM rayproject/ray:2.60.0-py311-gpu

# The base image's user `ray` (uid 1000) owns the Python environment; stay non-root.
USER ray
WORKDIR /home/ray/app

COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users serve_app ./serve_app
COPY --chown=ray:users deploy ./deploy
RUN pip install --no-cache-dir '.[gpu]'

# Model weights: the Hugging Face cache lives on a volume (a PVC on Kubernetes), so a
# restarted pod does not download 19 GB again. HF_TOKEN, if needed, comes from a Secret.
ENV HF_HOME=/models/hf
RUN sudo mkdir -p /models/hf && sudo chown -R ray:users /models
VOLUME ["/models"]

# 8000: Serve HTTP; 8265: Ray dashboard; 6379: Ray GCS; 8080: Prometheus metrics.
EXPOSE 8000 8265 6379 8080
CMD ["serve", "run", "deploy/config.yaml"]
