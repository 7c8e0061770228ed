"""Generation engines behind one narrow seam: the protocol, the steerable wrapper, mock and vLLM."""
