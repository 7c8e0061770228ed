"""`python -m worker`: the same as the `vllm-kafka-worker` command."""

import sys

from worker.cli.main import main

if __name__ == "__main__":  # vLLM spawns engine processes that re-import __main__
    sys.exit(main())
