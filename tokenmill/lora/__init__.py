"""Multi-LoRA serving: adapters read from PEFT folders or llama.cpp GGUF files (adapter.py), a wrapper that adds
each row's low-rank delta to a projection's output (layer.py), and the pool of loaded adapters and slots
(manager.py). ``LoRARequest`` (request.py) names the adapter a request runs with.

Importing the package loads nothing heavy: request.py and adapter.py need no torch, so the API process can check
an adapter's files without it."""
