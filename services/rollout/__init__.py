"""The rollout stage: samples G completions per prompt, adopts new policies, evaluates."""
