"""Two-node serving: the peer supervisor that each node's unit runs as its main process, vLLM as its
child."""
