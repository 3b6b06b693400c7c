"""A burst-side rollout replica fits beside the trainer, or refuses to start with what it measured."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.rollout.fit import GB, GIB, CardMemory, DoesNotFit, check_fit, measure, weights_bytes
from services.rollout.settings import RolloutSettings

H200 = int(141 * GB)


def _settings(**kw) -> RolloutSettings:
    return RolloutSettings(model="m", dev=True, **kw)


def test_a_share_that_fits_beside_the_trainer_starts():
    s = _settings(gpu_memory_utilization=0.3, trainer_reserve_gb=90)
    assert "fits beside the trainer" in check_fit(s, CardMemory("cuda:0", H200, H200))
    # The trainer already holds its reserve: what is free now is still enough.
    assert "fits" in check_fit(s, CardMemory("cuda:0", H200, H200 - int(90 * GB)))


def test_a_share_the_trainer_leaves_no_room_for_is_refused_with_the_measurements():
    s = _settings(gpu_memory_utilization=0.5, trainer_reserve_gb=90)
    with pytest.raises(DoesNotFit) as e:
        check_fit(s, CardMemory("cuda:0", H200, H200))
    msg = str(e.value)
    assert "needs 70.5 GB" in msg and "141.0 GB total" in msg and "leaves 51.0 GB" in msg
    assert "BURSTRL_ROLLOUT_GPU_MEMORY_UTILIZATION" in msg


def test_a_trainer_past_its_reserve_makes_the_replica_refuse_on_what_is_free():
    # The trainer's reserve would leave room, but it already uses more than it said.
    s = _settings(gpu_memory_utilization=0.3, trainer_reserve_gb=60)
    with pytest.raises(DoesNotFit, match=r"only 30\.0 GB are left for it .*30\.0 GB free now"):
        check_fit(s, CardMemory("cuda:0", H200, int(30 * GB)))


def test_beside_a_trainer_the_share_must_be_set():
    with pytest.raises(DoesNotFit, match="GPU_MEMORY_UTILIZATION must be set"):
        check_fit(_settings(trainer_reserve_gb=60), CardMemory("cuda:0", H200, H200))


def test_without_a_reserve_nothing_is_checked():
    assert "no trainer reserve" in check_fit(_settings(), CardMemory("cuda:0", H200, 0))


def test_on_vllm_cpu_the_need_is_the_weights_and_the_kv_space(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert weights_bytes(str(tmp_path)) == 1000
    s = RolloutSettings(model=str(tmp_path), dev=True, trainer_reserve_gb=4)
    assert "VLLM_CPU_KVCACHE_SPACE=2" in check_fit(s, CardMemory("cpu", 8 * GIB, 8 * GIB))
    with pytest.raises(DoesNotFit, match=r"needs 2\.1 GB"):
        check_fit(s, CardMemory("cpu", 8 * GIB, GIB))


def test_the_reserve_is_validated():
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValidationError, match="trainer_reserve_gb"):
            _settings(trainer_reserve_gb=bad)
    with pytest.raises(ValidationError, match="TRAINER_RESERVE_GB: a remote engine"):
        _settings(engine="remote", engine_url="http://x", trainer_reserve_gb=10)


def test_measure_reads_this_machine():
    card = measure()
    assert card.total > 0 and 0 <= card.free <= card.total
