"""vllm-kafka-worker: Kafka generation jobs in, vLLM completions with MoE routed experts out."""

__version__ = "0.1.0"
