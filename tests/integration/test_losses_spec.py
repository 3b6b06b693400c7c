"""The `algorithm` block's loss and correction options: defaults, bounds, and 422s that name the field."""

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from services.trainer.learner import loss_config
from services.trainer.losses import LossConfig
from shared.algorithm import AlgorithmSpec
from shared.job import JobSpec

TOKEN = "s3cr3t-token-for-tests-0123"


def _error(**algorithm) -> tuple[tuple, str]:  # noqa: ANN003
    with pytest.raises(ValidationError) as e:
        JobSpec(base_model="m", algorithm=algorithm)
    err = e.value.errors()[0]
    return tuple(err["loc"]), err["msg"]


def test_defaults_are_todays_recipe():
    a = AlgorithmSpec()
    assert (a.loss, a.mismatch, a.advantage, a.ratio_level) == ("ppo_clip", "token_truncate", "grpo", "token")
    # The trainer's config for the demo's spec is the one it always had (new fields at their defaults).
    cfg = loss_config(JobSpec(base_model="m"))
    assert cfg == LossConfig(clip_low=0.2, clip_high=0.28, max_tokens=8, tis_cap=2.0)


def test_a_stored_spec_with_new_options_reloads():
    spec = JobSpec(base_model="m", algorithm={"loss": "cispo", "cispo_max": 3.0, "mismatch": "m2po", "m2po_tau": 0.1})
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


@pytest.mark.parametrize(
    ("algorithm", "field", "says"),
    [
        ({"loss": "grpo"}, "loss", "'ppo_clip', 'cispo', 'sapo' or 'dppo_tv'"),
        ({"mismatch": "tis"}, "mismatch", "'icepop', 'geo_mask', 'm2po' or 'none'"),
        ({"advantage": "reinforce"}, "advantage", "'reinforce_plus_plus'"),
        ({"loss": "dppo_tv"}, "mismatch", "algorithm.mismatch = 'none'"),
        ({"loss": "cispo", "ratio_level": "sequence"}, "ratio_level", "'ppo_clip' or 'sapo'"),
        ({"loss": "dppo_tv", "mismatch": "none", "ratio_level": "sequence"}, "ratio_level", "not 'dppo_tv'"),
        ({"cispo_max": 3.0}, "cispo_max", "algorithm.loss = 'cispo'"),
        ({"loss": "sapo", "dppo_high": 0.1}, "dppo_high", "algorithm.loss = 'dppo_tv', not 'sapo'"),
        ({"m2po_tau": 0.1}, "m2po_tau", "algorithm.mismatch = 'm2po'"),
        ({"mismatch": "icepop", "geo_low": 0.9}, "geo_low", "algorithm.mismatch = 'geo_mask'"),
        ({"mismatch": "icepop", "mismatch_min": 0.3}, "mismatch_min", "icepop_low"),
        ({"mismatch": "m2po", "m2po_tau": float("nan")}, "m2po_tau", "finite"),
        ({"loss": "cispo", "cispo_max": float("inf")}, "cispo_max", "finite"),
        ({"loss": "sapo", "sapo_tau_neg": 0.0}, "sapo_tau_neg", "greater than 0"),
        ({"mismatch": "icepop", "icepop_high": 0.9}, "icepop_high", "greater than 1"),
        ({"mismatch": "geo_mask", "geo_low": 1.0}, "geo_low", "less than 1"),
        ({"mismatch": "m2po", "m2po_tau": -0.04}, "m2po_tau", "greater than 0"),
        ({"loss": "dppo_tv", "mismatch": "none", "dppo_low": 2.0}, "dppo_low", "less than or equal to 1"),
        ({"entropy_coef": float("nan")}, "entropy_coef", "finite"),
    ],
)
def test_bad_options_name_the_field_and_what_is_valid(algorithm, field, says):  # noqa: ANN001
    loc, msg = _error(**algorithm)
    assert loc == ("algorithm", field) and says in msg, (loc, msg)


def test_reinforce_plus_plus_is_not_a_turn_level_estimator():
    with pytest.raises(ValidationError, match="grpo, dr_grpo or rloo, not 'reinforce_plus_plus'"):
        JobSpec(
            base_model="m",
            env={"name": "calc"},
            algorithm={"advantage": "reinforce_plus_plus", "advantage_level": "turn"},
        )


@pytest.fixture
def client(r, redis_server):  # noqa: ANN001, ANN201
    from services.api.app import build_routes
    from services.api.settings import ApiSettings
    from shared.service import ServiceRuntime

    rt = ServiceRuntime("api", ApiSettings(redis_url=redis_server.url, token=TOKEN))
    build_routes(rt)
    with TestClient(rt.app) as c:
        c.headers["Authorization"] = f"Bearer {TOKEN}"
        yield c


def test_the_api_answers_422_naming_the_field(client):  # noqa: ANN001
    resp = client.post("/v1/jobs", json={"base_model": "m", "algorithm": {"loss": "no-such-loss"}})
    assert resp.status_code == 422
    d = resp.json()["detail"][0]
    assert d["loc"] == ["body", "algorithm", "loss"] and "'cispo'" in d["msg"]
    resp = client.post("/v1/jobs", json={"base_model": "m", "algorithm": {"loss": "dppo_tv"}})
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == ["body", "algorithm", "mismatch"]
    # JSON has no NaN, but Python's json (and so a client) writes one: refused, naming the field.
    raw = '{"base_model": "m", "algorithm": {"mismatch": "m2po", "m2po_tau": NaN}}'
    resp = client.post("/v1/jobs", content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"][-1] == "m2po_tau"
    ok = client.post("/v1/jobs", json={"base_model": "m", "algorithm": {"loss": "sapo", "mismatch": "m2po"}})
    assert ok.status_code == 201, ok.text
    assert ok.json()["spec"]["algorithm"]["m2po_tau"] == 0.04
