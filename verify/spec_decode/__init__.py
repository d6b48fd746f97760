"""Speculative-decoding rollback through KDA, judged for any design: `design` (what a design implements,
and the adapters), `contract` (the four properties every design must show its caller), `command` (the
`verify-kernels spec-decode` subcommand)."""
