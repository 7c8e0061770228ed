# The worker on vLLM's official image: vLLM and CUDA come from it, the worker is pip-installed.
FROM vllm/vllm-openai:v0.11.0
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY worker ./worker
RUN pip install --no-cache-dir .
ENTRYPOINT ["vllm-kafka-worker"]
CMD ["serve", "--help"]
