"""Tolerances the tests share, each with the reasoning that sizes it."""

# How far two fp32 computations of the same per-token log-probs may differ when only the batch
# shape differs (batch size, padding, micro-batch split, thread count): the BLAS kernels sum in
# another order, each step off by up to ~1.2e-7 relative, compounded through the layers and
# scaled by the logits. The worst seen: 2.0e-5 nats (one machine's locally built tiny model),
# 1.9e-6 under load. The bound below is 5x that; a real batching bug (padding attended to, a
# shifted position, a wrong mask) moves log-probs by 0.1 nats or more, 1000x above it.
FP32_LOGPROB_TOL = {"abs": 1e-4, "rel": 1e-5}

# How far two engines' fp32 log-probs of the same tokens may differ (vLLM against transformers):
# not only the summation order but other kernels (vLLM's attention and fused norms against
# transformers' eager ops). The worst seen: 2.1e-4 nats on one machine's locally built tiny model
# (log-probs ~ -13), against under 1e-4 on the build before. The bound is 5x that; a real scoring
# bug (a shifted position, the prompt's last token scored, a wrong adapter) moves log-probs by
# 0.1 nats or more, 100x above it.
FP32_ENGINE_LOGPROB_TOL = 1e-3

# How far two fp32 gradients of the same loss may differ when only the summation order differs
# (logits in chunks or whole, one rank or two), as a fraction of the tensor's largest entry, with
# an absolute floor for a tensor that is all ~0. The worst seen on the locally built tiny model:
# 1.03e-6 absolute on grads of magnitude <= 1 (chunked head; another build of the same recipe
# was under 1e-6). A real bug (a token's gradient dropped or sent to the wrong position, a chunk
# boundary off by one) changes gradients by a sizeable fraction of their magnitude.
FP32_GRAD_TOL = {"rel_to_max": 1e-4, "abs": 1e-6}


def assert_close_to_scale(got, want, what: str, tol: dict[str, float] = FP32_GRAD_TOL) -> None:  # noqa: ANN001
    """max |got - want| <= max(abs, rel_to_max x max |want|), on torch tensors, in float64."""
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    worst = float((got.detach().double() - want.detach().double()).abs().max()) if want.numel() else 0.0
    bound = max(tol["abs"], tol["rel_to_max"] * scale)
    assert worst <= bound, f"{what}: max |diff| {worst:.3g} > {bound:.3g} (max |want| {scale:.3g})"


# How far two AdamW runs of the same steps may end apart when only the summation order differs
# (sharded against one process). AdamW's update is m/sqrt(v): for an entry whose gradient is near
# zero, float noise decides the sign of an lr-sized move, and such entries exist by structure
# (q_proj and k_proj: softmax ignores a shift shared by all scores). How many there are depends on
# the build of the model: none beyond 1e-3 on one, 0.7% of all entries beyond 1e-3 (max 1.3e-2,
# mean 3.4e-5) on another, so no bound on single entries, their share or the mean holds. Noise
# cannot move most entries: 90% of them must lie within 10% of one AdamW step (the median move of
# one step, measured in the same run). The build with no entry beyond 1e-3 had its 90th percentile
# at 5.2e-8 against a step of 1.1e-3 (2000x inside); one extra step (a group trained twice) puts it
# at 1.0 step, 10x outside; a resume with its AdamW moments lost, at 8.2 steps (82x outside).
ADAM_TRAJECTORY_TOL = {"quantile": 0.9, "of_step": 0.1}


def assert_same_adam_trajectory(got, want, step: float, tol: dict[str, float] = ADAM_TRAJECTORY_TOL) -> None:  # noqa: ANN001
    """`got` and `want` (name -> tensor) are the same AdamW trajectory: the `quantile` of
    |got - want| over all entries is under `of_step` x `step` (one step's median move)."""
    import torch

    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:3]
    diff = torch.cat([(got[k].double() - want[k].double()).abs().flatten() for k in sorted(want)])
    q = float(diff.quantile(tol["quantile"]))
    far = float((diff > step).double().mean())
    print(
        f"{tol['quantile']:.0%} of {diff.numel()} entries within {q:.2e} of the other run (one step: {step:.2e}); "
        f"{far:.2e} of them more than a step away, mean {float(diff.mean()):.2e}, max {float(diff.max()):.2e}"
    )
    assert q < tol["of_step"] * step, (
        f"{tol['quantile']:.0%} quantile of |diff| {q:.3g} >= {tol['of_step']} x one step ({step:.3g}): "
        "most entries moved, as an extra or a missing step would move them"
    )
