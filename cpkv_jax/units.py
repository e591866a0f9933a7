"""Byte units, one definition for the whole tree."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
