"""The lab's harness: what the benchmarks in bench/ share with each other and with the tests.

- `stack`: redis-server and the services as local processes (what `burstrl up` runs), job
  submission and a job run to completion; `stages`: each pipeline stage run alone;
- `jobs`: the job shapes several benchmarks run (the demo's, a burst's, the backlog settings);
- `heldout`: the one held-out evaluator every comparison uses, and its workloads;
- `trl`: TRL's GRPOTrainer on the same workload, in a process of its own;
- `memory`: peak tensor memory under torch's profiler, one fresh interpreter per case;
- `s3`: the S3 stand-in (moto, started by tests/support/servers.py) with the store's settings;
- `results`: where a benchmark's page, JSON and headline figures go; `plots`: accuracy curves.

Why it lives in tests/support/ and not in a bench/harness/ package: tests/support/ is already the
harness shared by tests/ and bench/ (bench/rollout_*.py, bench/backlog.py and bench/chaos.py use its
servers, rollout and backlog pieces), so imports keep pointing one way: bench/ -> tests/support/ ->
the product, and tests/ -> tests/support/. A harness under bench/ would have the tests import bench/
for the same pieces, or split one harness in two. Nothing here is a benchmark or a test, and nothing
here imports bench/.
"""
