"""Speculative-decoding rollback through KDA, judged for any design: `design` (what a design implements,
and the designs shipped), `drive` (a drive's inputs from its seed, the reference over a draft),
`contract` (the four properties every design must show its caller), `command` (the
`verify-kernels spec-decode` subcommand)."""
