"""The bus: Redis streams, message models and codec, ZeroMQ RPC, a local redis-server, the config
sections and state-hash fields every worker shares. It imports nothing from ``workers/`` or ``trainer/``.
"""
