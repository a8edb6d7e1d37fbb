"""The inference servers: the ``rlbus inference`` entry (``server``), the built-in transformers server
over its dynamic-batching engine, the OpenAI API rendering, the weights follower, the client the rollout
worker uses, and the vLLM launcher.
"""
