"""The decode server's parts: `engine` (`DecodeEngine`, modes null and decode: page
reservation, room adoption, batched decode steps) and `sampling` (stateless per-request
sampling and stop checks, also used for the prefill server's first token)."""
