"""Tolerances the tests share, each with the reasoning that sizes it."""

# How far two fp32 computations of the same per-token log-probs may differ when only the batch
# shape differs (batch size, padding, micro-batch split, thread count): the BLAS kernels sum in
# another order, each step off by up to ~1.2e-7 relative, compounded through the layers and
# scaled by the logits. The worst seen: 2.0e-5 nats (one machine's locally built tiny model),
# 1.9e-6 under load. The bound below is 5x that; a real batching bug (padding attended to, a
# shifted position, a wrong mask) moves log-probs by 0.1 nats or more, 1000x above it.
FP32_LOGPROB_TOL = {"abs": 1e-4, "rel": 1e-5}
