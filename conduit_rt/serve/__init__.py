"""``conduit serve``: an OpenAI-compatible HTTP server over one Runtime, decoding concurrent requests
together (continuous batching).

- ``api_errors``: the OpenAI error object and the status code of each error;
- ``schema``: a chat-completion request body -> messages and options, and the response bodies;
- ``images``: ``image_url`` parts -> image payloads (``data:`` URIs, http(s) fetches, local files);
- ``engine``: the scheduler thread that owns the Runtime: admission, prefill, batched decode steps;
- ``metrics``: the Prometheus metrics;
- ``app``: the FastAPI routes; ``server``: the Runtime, engine and uvicorn behind ``conduit serve``.

Needs the ``serve`` extra (``pip install "conduit-rt[serve]"``).
"""
