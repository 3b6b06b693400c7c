"""burstrl's services: one package per role (api, rollout, reward, ref, trainer) and the CLI."""
