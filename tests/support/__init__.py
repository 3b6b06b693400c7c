"""The test harness, shared by tests/ and bench/: real servers on free ports, service stacks,
published policy versions, and the scripts tests run as separate processes.

Tests import from here, never from another test module or from bench/ (docs/architecture.md,
"Tests in layers"). Nothing here is a test.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
