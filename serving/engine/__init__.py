"""The engine side of a server: the plain-data contract HTTP talks to (`api`), the thread
that steps an engine (`loop`), the bounded wait queue (`wait_queue`), what a failed step
leaves behind (`step_failures`) and a deterministic mock engine for tests of the HTTP
app and the router (`mock`).

Nothing is re-exported here: import from the submodules, so that importing one part does
not pull in the others.
"""
