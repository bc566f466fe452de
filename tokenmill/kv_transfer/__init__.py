"""Prefill/decode disaggregation: the KV connector (connector.py), its frames (frames.py) and the router
(router.py) that sends each request's prefill to a producer and its decode to a consumer."""
