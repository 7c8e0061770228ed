# The worker on vLLM's official image: vLLM and CUDA come from it, the worker is pip-installed.
# The tag is the release the `gpu` extra admits (tests/test_compose.py holds the two together).
FROM vllm/vllm-openai:v0.32.0
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY worker ./worker
RUN pip install --no-cache-dir .
ENTRYPOINT ["vllm-kafka-worker"]
CMD ["serve", "--help"]
