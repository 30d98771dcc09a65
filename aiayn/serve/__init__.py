"""``aiayn serve RUN``: a translation / generation HTTP server and an attention explorer page.

Needs the optional ``serve`` extra (Starlette, uvicorn): ``pip install 'aiayn[serve]'``. Running it (options,
binding, the graceful stop) is :mod:`aiayn.serve.server`; the endpoints are listed in :mod:`aiayn.serve.app`,
request limits and error codes in :mod:`aiayn.serve.schemas`, the dynamic batching in :mod:`aiayn.serve.batcher`;
docs/serve.md shows them with curl. This face imports no web framework: ``aiayn --help`` stays fast.
"""

from aiayn.serve.server import RedactKeys, ServeOptions, add_serve_options, listen, redact_access_log, serve, serve_cli

__all__ = ["RedactKeys", "ServeOptions", "add_serve_options", "listen", "redact_access_log", "serve", "serve_cli"]
