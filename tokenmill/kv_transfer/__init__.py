"""Prefill/decode disaggregation: the KV connector (connector.py) and its frames (frames.py). The router that
sends each request's prefill to a producer and its decode to a consumer is a server (server/router.py)."""
