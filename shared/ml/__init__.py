"""The torch side of shared code: per-token log-probs (trainer, ref, probe), and the tiny
demo and test models with their SFT warm-starts.

Only the heavy roles (trainer, ref, rollout) and the model builder import this package;
the runtime core (`shared/`) and the domain plugins (`shared/domain/`) never do, so the
light services (api, reward) start without torch.
"""
