"""The test harness, shared by tests/ and bench/: real servers on free ports, service stacks,
published policy versions, and the scripts tests run as separate processes; `tests.support.lab`
holds the benchmarks' share of it (stacks, job shapes, held-out evaluation, results).

Tests import from here, never from another test module; bench/ imports from here, never from
tests/ outside it (docs/architecture.md, "Tests in layers"). Nothing here is a test or a benchmark.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
