"""PD transfer of CP ranks' owned KV pages to a decode server, by logical position.
Must not import `serving`. Arrives with the transfer issue (nothing is exported yet)."""
