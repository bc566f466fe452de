"""The OpenAI-compatible HTTP server (``tokenmill serve``).

``tokenmill.server.app``: build_app / serve / BackgroundServer; ``protocol``: request schemas and
the error object; ``metrics``: the Prometheus collectors; ``args``: the CLI flags. Importing this
package is cheap; the FastAPI parts load with ``tokenmill.server.app``.
"""
