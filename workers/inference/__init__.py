"""The inference server: dynamic-batching engine, OpenAI API, weights follower, client, vLLM launcher."""
