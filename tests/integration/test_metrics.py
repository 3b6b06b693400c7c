"""Metric points: what the dashboard, the CLI and the trackers read."""

import json

import numpy as np
import pytest

from shared import keys
from shared.metrics import read_points, record_point


def test_points_are_strict_json_even_with_nan_and_numpy(r):
    record_point(r, "m-1", "trainer", {"loss": float("nan"), "kl": np.float32(0.25), "parts": {"correct": 1}})
    raw = r.xrange(keys.metrics("m-1"))[0][1][b"m"]
    # Browsers' JSON.parse rejects NaN; the stored point must be strict JSON.
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    [p] = read_points(r, "m-1", "trainer")
    assert p["loss"] is None and p["kl"] == 0.25 and p["parts"] == {"correct": 1}


def test_a_value_that_is_not_data_is_refused(r):
    with pytest.raises(TypeError, match="not a number"):
        record_point(r, "m-1", "trainer", {"oops": object()})
