"""PD transfer of CP ranks' owned KV pages to a decode server, by logical position.

`capabilities` (backend capability registry, SPEC S2.3) and `page_plan` (per-rank page
plans, coalesced descriptors, layout descriptor, page digests) are host-side and
JAX-free. Must not import `serving`.
"""
