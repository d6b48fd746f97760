"""Kernels a user brings to `verify-kernels run --candidate module:attr`, one module each (a module's
DTYPES / PARAMS declarations apply to every kernel in it): the CLI tests run them as a new user would."""
