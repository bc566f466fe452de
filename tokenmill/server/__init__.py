"""The OpenAI-compatible HTTP server (``tokenmill serve``).

``app``: build_app (routes and error handlers); ``run``: serve, the drain, BackgroundServer, ``tokenmill
serve``; ``serving`` (checks and SamplingParams shared by the endpoints), ``completions``, ``chat``,
``streaming``, ``logprobs``, ``responses``, ``middleware`` (API key, body limit); ``tools`` and
``tool_parsers`` (tool calls in and out), ``reasoning`` (--reasoning-parser), ``chat_template``
(--chat-template); ``protocol``: request schemas and the error object; ``metrics``: the Prometheus
collectors; ``args``: the CLI flags. Importing this package is cheap; the FastAPI parts load with
``tokenmill.server.app``.
"""
