"""``tokenmill bench``: serving and offline benchmarks.

- ``serve``: drives any OpenAI-compatible server (tokenmill, vLLM, llama.cpp's llama-server) with a
  workload (datasets.py, trace.py) on an arrival schedule (arrivals.py) through streaming HTTP
  requests (client.py, runner.py), and reports vLLM's serving metrics (metrics.py), sweeps and
  side-by-side comparisons (serve.py, report.py) and plots (plots.py, timeline.py).
- ``offline``: engine-only throughput through ``LLM.generate`` (offline.py).
"""
