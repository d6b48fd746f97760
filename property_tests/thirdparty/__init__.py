"""Adapters of third-party kernel libraries to an op's signature, certified as any user's candidate
(never part of the project: the library is installed only where the GPU script runs them)."""
