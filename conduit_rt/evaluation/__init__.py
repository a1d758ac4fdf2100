"""``conduit eval``: refresh and compression policies side by side on replayed document-QA sessions.

- ``sessions``: where a test request's pages were seen before (earlier requests of the session).
- ``replay``: the settings (policy x budget rows), one session on a Runtime, the request loop.
- ``shards``: the test requests, replayed in one process or in several sharing the device.
- ``metrics``: accuracy and fidelity against the full-prefill run (docs/methods.md §4).
- ``report``: results.json -> markdown tables, the plot, the docs page (docs/quality.md).
- ``cli``: the command (``main(argv)``).
"""
