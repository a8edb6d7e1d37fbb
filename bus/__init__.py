"""The bus: Redis streams, message models and codec, ZeroMQ RPC, a local redis-server."""
