"""Issue 44 items 4-6: every service's answers encode whatever the request held, names and ids are
matched whole and show what they are, and a 422 stays small however many errors a body has.

The real api app over a real Redis (FastAPI's TestClient, and uvicorn over real HTTP), and the
runtime every other service builds its app from.
"""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, ValidationError

from shared import keys
from shared.http_errors import SurrogateScanner
from shared.limits import ERROR_LIST_MAX
from shared.service import ServiceRuntime
from shared.settings import CommonSettings
from tests.support.api import api_client
from tests.support.api import served as serve

TOKEN = "http-errors-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


@pytest.fixture
def client(r, redis_server):  # noqa: ANN001
    with api_client(redis_server.url, TOKEN) as c:
        yield c


@pytest.fixture
def served(client):  # noqa: ANN001
    with serve(client.app) as url:
        yield url


def _post(url: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/jobs", content=body, headers=AUTH, timeout=30)


# -- item 4: text that cannot be encoded -----------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        b'{"base_model": "m\\ud800"}',  # refused anyway (a surrogate is no model id): the 422 echoing it was a 500
        b'{"base_model": "m", "name": "\\udfff"}',
        b'{"base_model": "m", "task_spec": {"template": "Q: {prompt} \\ud83d"}}',  # else accepted: stored, a 500
        b'{"base_model": "m", "sampling": {"stop": ["\\ud800\\\\udc00"]}}',  # an escaped backslash is no pair
        b'{"base_model": "m", "task_spec": {"verifiers": [{"name": "regex", "args": {"pattern": "\\udc00"}}]}}',
    ],
)
def test_a_lone_surrogate_in_a_body_is_a_422_that_says_so(served: str, body: bytes) -> None:
    resp = _post(served, body)
    assert resp.status_code == 422, resp.text
    (err,) = resp.json()["detail"]
    assert err["type"] == "lone_surrogate" and "surrogate" in err["msg"], err
    assert body[err["ctx"]["offset"] :].startswith(err["ctx"]["escape"].encode())
    # The connection and the server are fine afterwards.
    assert _post(served, b'{"base_model": "m"}').status_code == 201


def test_a_surrogate_pair_and_escaped_backslashes_are_text(served: str) -> None:
    body = b'{"base_model": "m", "task_spec": {"template": "\\ud83d\\ude00 {prompt} \\\\ud800"}}'
    resp = _post(served, body)
    assert resp.status_code == 201, resp.text
    assert resp.json()["spec"]["task_spec"]["template"] == "\U0001f600 {prompt} \\ud800"


def test_a_surrogate_split_across_chunks_is_found() -> None:
    body = b'{"a": "x\\ud83d\\ude00\\\\ud800\\ud800y"}'  # a pair, an escaped backslash, then a lone half
    for step in range(1, len(body) + 1):
        scanner, found = SurrogateScanner(), None
        for i in range(0, len(body), step):
            found = found or scanner.feed(body[i : i + step], last=i + step >= len(body))
        assert found is not None and found.detail[0]["ctx"] == {"escape": "\\ud800", "offset": body.rindex(b"\\ud800")}


class _Echo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int


@pytest.mark.parametrize("role", ["api", "reward", "rollout", "ref", "trainer"])
def test_every_services_errors_are_small_and_encodable(role: str, redis_server) -> None:  # noqa: ANN001
    """Every service builds its app in ServiceRuntime: its 422s and other errors are made there."""
    rt = ServiceRuntime(role, CommonSettings(redis_url=redis_server.url, token=TOKEN))

    @rt.app.post("/echo")
    def echo(body: _Echo) -> dict[str, int]:
        return {"n": body.n}

    @rt.app.get("/refuse")
    def refuse() -> None:
        from fastapi import HTTPException

        raise HTTPException(409, "cannot: a\ud800b")  # a message built from stored or echoed text

    @rt.app.get("/answer")
    def answer() -> dict[str, str]:
        return {"text": "x\udcffy"}  # text from anywhere that holds a lone surrogate

    with TestClient(rt.app) as c:
        c.headers["Authorization"] = f"Bearer {TOKEN}"  # every path but health needs it (shared/http_door.py)
        many = {f"k{i}": i for i in range(100_000)}  # ~1.3 MB of unknown keys
        resp = c.post("/echo", content=json.dumps(many).encode(), headers={"Content-Type": "application/json"})
        assert resp.status_code == 422 and len(resp.content) < 10_000, len(resp.content)
        detail = resp.json()["detail"]
        assert len(detail) == ERROR_LIST_MAX + 1
        assert detail[-1]["type"] == "too_many_errors" and detail[-1]["ctx"]["not_listed"] == 100_001 - ERROR_LIST_MAX
        resp = c.post("/echo", content=b'{"n": "\\ud800"}', headers={"Content-Type": "application/json"})
        assert resp.status_code == 422 and resp.json()["detail"][0]["type"] == "lone_surrogate", resp.text
        resp = c.get("/refuse")
        assert (resp.status_code, resp.json()) == (409, {"detail": "cannot: a\ufffdb"})
        resp = c.get("/answer")
        assert (resp.status_code, resp.json()) == (200, {"text": "x\ufffdy"})


# -- item 6: oversized error answers ---------------------------------------------------------------
def test_an_800kb_body_of_unknown_keys_gets_a_small_422(served: str) -> None:
    body = json.dumps({"base_model": "m", **{str(i): 0 for i in range(100_000)}}, separators=(",", ":")).encode()
    assert 700_000 < len(body) < 1 << 20
    resp = _post(served, body)
    assert resp.status_code == 422
    assert len(resp.content) < 10_000, len(resp.content)  # was 9.7 MB with 100,000 errors
    detail = resp.json()["detail"]
    assert [d["loc"] for d in detail[:2]] == [["body", "0"], ["body", "1"]]
    assert detail[-1]["msg"].startswith(f"{100_000 - ERROR_LIST_MAX} more errors not listed")


# -- item 5: names and ids ---------------------------------------------------------------------------
def _field(resp: httpx.Response) -> str:
    assert resp.status_code == 422, resp.text
    return resp.json()["detail"][0]["loc"][-1]


@pytest.mark.parametrize("name", ["job\n", "job\r\n", "job\u200b", "\u202ejob"])
def test_a_job_name_is_matched_whole(client: TestClient, name: str) -> None:
    # "job\n" passed re.match with "$": the id then held a newline in Redis keys, store folders, logs.
    assert _field(client.post("/v1/jobs", json={"base_model": "m", "name": name})) == "name"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("base_model", "org/model\u202etxt.exe"),  # a right-to-left override: shows as "org/modelexe.txt"
        ("base_model", "org/mo\u200bdel"),  # a zero-width space: two ids that look the same
        ("base_model", "org/\u2066model\u2069"),
        ("base_model", "org/model\u2028"),  # a line separator
        ("teacher", "org/teach\u00ader"),  # a soft hyphen
        ("task", "ari\u200dth"),
        ("verifier", "exa\ufeffct"),
    ],
)
def test_identifiers_refuse_format_characters(client: TestClient, field: str, value: str) -> None:
    body = {"base_model": "m", field: value, **({"kl_coef": 0.1} if field == "teacher" else {})}
    resp = client.post("/v1/jobs", json=body)
    assert _field(resp) == field
    assert "format characters" in resp.json()["detail"][0]["msg"]


def test_source_paths_and_columns_refuse_them_too(client: TestClient, tmp_path) -> None:  # noqa: ANN001
    hidden = tmp_path / "prompts\u202elsonj.jsonl"  # a real file: only its name is wrong
    plain = tmp_path / "prompts.jsonl"
    for f in (hidden, plain):
        f.write_text('{"q": "1+1", "answer": "2"}\n')

    def job(path: str, prompt_field: str) -> dict:
        source = {"kind": "jsonl", "path": path, "prompt_field": prompt_field}
        return {"base_model": "m", "task": "t", "task_spec": {"source": source, "verifiers": [{"name": "exact"}]}}

    for body, field in ((job(str(hidden), "q"), "path"), (job(str(plain), "q\u200b"), "prompt_field")):
        resp = client.post("/v1/jobs", json=body)
        assert _field(resp) == field
        assert "format characters" in resp.json()["detail"][0]["msg"], resp.json()
    assert client.post("/v1/jobs", json=job(str(plain), "q")).status_code == 201
    assert client.post("/v1/jobs", json={"base_model": "org/modèle-ünïcode"}).status_code == 201  # letters are fine


def test_settings_ids_are_matched_whole_and_shown_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="replica"):
        CommonSettings(replica="box-1\u202e")
    with pytest.raises(ValidationError, match="replica"):
        CommonSettings(replica="box-1\n")
    monkeypatch.setenv("BURSTRL_REDIS_PREFIX", "burstrl\n")  # a trailing newline passed re.match with "$"
    with pytest.raises(ValueError, match="BURSTRL_REDIS_PREFIX"):
        keys._prefix()
    monkeypatch.setenv("BURSTRL_REDIS_PREFIX", "burstrl-test")
    assert keys._prefix() == "burstrl-test"
