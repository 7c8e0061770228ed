"""The command line: `vllm-kafka-worker serve|submit|results|control|status|...`."""
