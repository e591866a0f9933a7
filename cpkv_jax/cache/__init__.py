"""KV caches above the device pools: the radix prefix cache (`radix`), host side only.

Core library (SPEC S3.2, S4): the serving scheduler keeps policy (when to match, insert,
evict); what a cached page is and how it is found lives here.
"""
