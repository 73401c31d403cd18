"""The compute paths under the decoder: paged attention (torch, C, Triton), the C layer, MoE and RMSNorm kernels, and which of them a process runs."""
