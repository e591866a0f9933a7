"""Idle HTTP connection lifetimes of the servers, the router, and the router's pool.

A client must drop an idle keep-alive connection before the server closes it: with both
at uvicorn's and httpx's 5 s, a request could go out on a connection the server was just
closing (a ReadError; one request of a PD load test run answered 503, 2026-12-04).
"""

# How long `cpkv-serve` and `cpkv-router` keep an idle client connection open.
HTTP_KEEPALIVE_S = 75
# How long the router keeps an idle connection to a server in its pool (< the above).
UPSTREAM_KEEPALIVE_S = 30.0
