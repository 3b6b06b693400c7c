"""Domain plugins: what a job names and the stages plug in.

- `tasks/`: prompt sources (synthetic tasks, jsonl/parquet/datasets files) and their scorers;
- `verifiers/`: reward functions (exact, regex, format, math, code, http, judges);
- `envs/`: multi-turn environments (tools, games) rollout drives episodes through;
- `sandbox/`: the namespace sandbox that code rewards and the python tool run in.

Pure Python, no torch or vllm: the api validates jobs against them and the reward service
scores with them. They depend on the runtime core (`shared/`), never the other way round.
"""
