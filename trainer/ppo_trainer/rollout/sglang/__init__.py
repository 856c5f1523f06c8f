"""SGLang as the rollout backend: server arguments, launching, the HTTP client, and the engine adapter.

Written for SGLang 0.5.23 and sglang-router 0.3.2 (the versions whose server code the request and
response shapes were read from; docs/sglang.md). Nothing here imports sglang: the servers are
separate processes spoken to over HTTP, so this package's tests run it against a test double
(`tests/doubles/sglang_server.py`) that answers the same endpoints with the same shapes.
"""

SGLANG_VERSION = "0.5.23"
SGLANG_ROUTER_VERSION = "0.3.2"
