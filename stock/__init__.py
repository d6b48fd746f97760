"""The stock decode layer: the K3 layer step composed from the kernels a serving engine uses without
custom fusion (torch / cuBLAS GEMMs, torch norms and activations, MXFP4 dequantised then batched
GEMMs, fla-core's KDA recurrence on CUDA), sync-free so one step can be captured in a CUDA graph."""
