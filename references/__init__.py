"""Plain, readable PyTorch references for every op of a Kimi K3 decode layer.

Every function is dtype-generic: called with float64 tensors it is the oracle, called with
bf16/fp16/fp32 tensors it is the working-precision baseline. Internal "fp32" steps of K3 use
`acc_dtype(x)`, which is float32 for low-precision inputs and float64 for the oracle.
"""
