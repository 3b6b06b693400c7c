"""Each built-in verifier, the registry and plugins, combinations and length shaping."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shared.domain.sandbox import check_isolation
from shared.domain.verifiers import (
    Scored,
    VerifierError,
    get_verifier,
    load_plugins,
    register_verifier,
    score_components,
    split_parts,
    verifier_names,
)
from shared.domain.verifiers.http import ALLOW_ENV
from shared.task_spec import VerifierRef
from tests.support.plugins import plugin_module


def run(name: str, completions: list[str], **kw: object) -> list[float]:
    return list(get_verifier(name)(completions, **kw))


def test_exact() -> None:
    assert run("exact", [" 12\n", "12.0", "x"], answer="12") == [1.0, 0.0, 0.0]
    assert run("exact", ["Paris"], answer="paris", case_sensitive=False) == [1.0]
    with pytest.raises(VerifierError, match="answer"):
        run("exact", ["1"])


@pytest.mark.parametrize(
    ("completion", "answer", "ok"),
    [
        ("so the answer is \\boxed{\\frac{2}{4}}", "\\frac12", True),  # equivalent fractions, LaTeX gold
        ("\\boxed{2/4}", "1/2", True),  # plain vs plain
        ("The answer is $\\dfrac{3}{6}$.", "0.5", True),  # LaTeX vs decimal
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", True),  # rationalised surd
        ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", True),  # sets ignore order
        ("total: \\boxed{1,000}", "1000", True),  # thousands separator
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", True),  # symbolic equality
        ("\\boxed{\\frac{3}{4}}", "\\frac{4}{3}", False),
        ("\\boxed{0.33}", "\\frac13", False),
        ("I am not sure.", "3", False),
    ],
)
def test_math_equivalence_hard_cases(completion: str, answer: str, ok: bool) -> None:
    assert run("math", [completion], answer=answer) == [1.0 if ok else 0.0]


def test_math_reasons_and_bad_gold() -> None:
    (r,) = run("math", ["no number here"], answer="3")
    assert r == 0.0 and isinstance(r, Scored) and r.reason == "no_answer"
    with pytest.raises(VerifierError, match="gold answer"):
        run("math", ["\\boxed{1}"], answer="")


def test_math_in_a_thread_has_no_signal_trouble() -> None:
    out: list[list[float]] = []
    t = threading.Thread(target=lambda: out.append(run("math", ["\\boxed{1/2}"], answer="0.5")))
    t.start()
    t.join()
    assert out == [[1.0]]


def test_regex_and_format() -> None:
    assert run("regex", ["Answer: 42", "42"], pattern=r"^Answer: \d+$") == [1.0, 0.0]
    assert run("regex", ["ANSWER: 1"], pattern="answer", flags="i") == [1.0]
    assert run("format", ["<think>hm</think> <answer>4</answer>", "<answer>4</answer>"]) == [1.0, 0.0]
    with pytest.raises(VerifierError, match="compile"):
        run("regex", ["x"], pattern="(")


def test_catastrophic_patterns_match_in_linear_time() -> None:
    """`(a+)+$` backtracked exponentially under Python's re (24 characters: 1.7 s, doubling per
    character); under RE2 a 100k-character miss is as quick as any other match."""
    text = "a" * 100_000 + "b"
    assert run("regex", [text, "aaaa"], pattern="(a+)+$") == [0.0, 1.0]
    assert run("regex", [text], pattern="^(a|aa)+$", mode="fullmatch") == [0.0]
    assert run("format", ["<think>" + "x" * 50_000, "<think>a</think><answer>1</answer>"]) == [0.0, 1.0]


def test_regex_flags_under_re2() -> None:
    assert run("regex", ["x\nANSWER: 7"], pattern="^answer: \\d$", flags="im") == [1.0]
    assert run("regex", ["a\nb"], pattern="a.b", flags="s") == [1.0]
    assert run("regex", ["a\nb"], pattern="a.b") == [0.0]
    with pytest.raises(VerifierError, match="RE2"):
        run("regex", ["x"], pattern="(?<=a)b")
    with pytest.raises(VerifierError, match="flags"):
        run("regex", ["x"], pattern="x", flags="x")


def test_overlong_penalty_is_dapos() -> None:
    # L=20, cache 4: 0 up to 16 tokens, linear to -1 at 20, -1 beyond
    got = run("overlong", ["a"] * 5, completion_tokens=[10, 16, 18, 20, 25], max_tokens=20, cache=4)
    assert got == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    assert run("overlong", ["a"], completion_tokens=[8], max_tokens=8) == pytest.approx([-1.0])


@pytest.mark.skipif(not check_isolation()[0], reason="sandbox unavailable here")
def test_code_verifier_extracts_and_runs() -> None:
    tests = json.dumps([{"call": "f", "args": [3], "expected": 9}, {"call": "f", "args": [-2], "expected": 4}])
    good = "Here:\n```python\ndef f(x):\n    return x * x\n```"
    half = "```python\ndef f(x):\n    return 9\n```"
    hack = "```python\nimport sys\nsys.exit(0)\n```"
    got = run("code", [good, half, hack], tests=tests)
    assert got == [1.0, 0.5, 0.0]
    assert run("code", [half], tests=tests, all_or_nothing=True) == [0.0]
    with pytest.raises(VerifierError, match="tests"):
        run("code", [good], tests="[]")


# -- HTTP reward models: real servers on loopback ---------------------------------------
class _RM(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def log_message(self, *a: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _RM.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        if self.path == "/score":
            reply = {"rewards": [len(c) / 10 for c in body["completions"]]}
        elif self.path == "/v1/chat/completions":
            text = body["messages"][0]["content"]
            reply = {"choices": [{"message": {"content": "7" if "good" in text.split("Response:")[-1] else "meh"}}]}
        else:
            self.send_response(404)
            self.end_headers()
            return
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def rm_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _RM)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    monkeypatch.setenv(ALLOW_ENV, base + "/")
    _RM.seen.clear()
    yield base
    srv.shutdown()
    srv.server_close()


def test_http_reward_model(rm_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RM_KEY", "s3cret")
    got = run("http", ["abc", "abcdefghij"], url=f"{rm_server}/score", prompt="p", answer="x", api_key_env="RM_KEY")
    assert got == pytest.approx([0.3, 1.0])
    assert _RM.seen[0]["auth"] == "Bearer s3cret"
    assert _RM.seen[0]["body"] == {"prompt": "p", "completions": ["abc", "abcdefghij"], "fields": {"answer": "x"}}


def test_http_urls_must_be_allowed(rm_server: str) -> None:
    with pytest.raises(VerifierError, match=ALLOW_ENV):
        run("http", ["a"], url="http://169.254.169.254/latest")


def test_openai_compatible_judge(rm_server: str) -> None:
    got = run("openai_judge", ["a good one", "bad"], url=f"{rm_server}/v1", model="judge", prompt="q?")
    assert got[0] == pytest.approx(0.7)
    assert got[1] == 0.0 and got[1].reason == "judge_unparsable"
    assert _RM.seen[0]["body"]["model"] == "judge"


def test_unreachable_rm_is_an_error_tag_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOW_ENV, "http://127.0.0.1:9/")
    comps = [VerifierRef(name="http", args={"url": "http://127.0.0.1:9/score", "timeout_s": 1})]
    parts = score_components(comps, ["a", "b"], {})
    assert parts == [{"http": 0.0, "http!error:ConnectError": 0.0}] * 2


@pytest.mark.skipif(not check_isolation()[0], reason="sandbox unavailable here")
def test_a_forged_sandbox_report_does_not_zero_honest_siblings() -> None:
    # One solution writing to the sandbox's old report pipe (fd 4) made run_code raise, and the
    # whole group scored 0 tagged error:TypeError / error:RecursionError.
    tests = json.dumps([{"stdin": "1 2", "stdout": "3"}, {"stdin": "5 7", "stdout": "12"}])
    honest = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    forged = [
        '```python\nimport os\nos.write(4, b\'{"i": 0, "ret": 5}\\n\')\n```',
        "```python\nimport os\nos.write(4, b'[' * 100000)\n```",
    ]
    parts = score_components([VerifierRef(name="code")], [honest, *forged, honest], {"tests": tests})
    assert parts[0] == {"code": 1.0} and parts[3] == {"code": 1.0}, parts
    for p in parts[1:3]:
        assert p["code"] == 0.0 and not any(k.startswith("code!error:") for k in p), p


# -- combinations, registry, plugins ---------------------------------------------------
def test_weighted_combination_keeps_every_part() -> None:
    comps = [
        VerifierRef(name="math", weight=1.0, part="correct"),
        VerifierRef(name="regex", weight=0.2, part="format", args={"pattern": r"\\boxed\{"}),
        VerifierRef(name="overlong", args={"cache": 4}),
        VerifierRef(name="nope"),
    ]
    parts = score_components(
        comps, ["\\boxed{4}", "4", "\\boxed{5}"], {"answer": "4"}, completion_tokens=[3, 3, 19], max_tokens=20
    )
    assert parts[0] == {"correct": 1.0, "format": 0.2, "overlong": 0.0, "nope": 0.0, "nope!misconfigured": 0.0}
    assert parts[1]["correct"] == 1.0 and parts[1]["format"] == 0.0
    assert parts[2]["overlong"] == pytest.approx(-0.75) and "overlong!overlong" in parts[2]
    values, tags = split_parts(parts[2])
    assert sum(values.values()) == pytest.approx(0.2 - 0.75) and tags == ["overlong!overlong", "nope!misconfigured"]


def test_a_raising_verifier_scores_zero_tagged() -> None:
    @register_verifier("boom_test", replace=True)
    def boom(completions: list[str], **_: object) -> list[float]:
        raise RuntimeError("bug")

    @register_verifier("short_test", replace=True)
    def short(completions: list[str], **_: object) -> list[float]:
        return [1.0]

    @register_verifier("nan_test", replace=True)
    def nan(completions: list[str], **_: object) -> list[float]:
        return [float("nan")] * len(completions)

    parts = score_components(
        [VerifierRef(name="boom_test"), VerifierRef(name="short_test"), VerifierRef(name="nan_test")], ["a", "b"], {}
    )
    assert parts[0] == {
        "boom_test": 0.0,
        "boom_test!error:RuntimeError": 0.0,
        "short_test": 0.0,
        "short_test!misconfigured": 0.0,
        "nan_test": 0.0,
        "nan_test!nonfinite": 0.0,
    }


def test_registry_refuses_silent_overrides() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_verifier("exact", lambda c, **_: [0.0] * len(c))
    with pytest.raises(VerifierError, match="BURSTRL_REWARD_PLUGINS"):
        get_verifier("not-a-verifier")


def test_plugins_load_from_named_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shouty = (
        "from shared.domain.verifiers import register_verifier\n"
        "@register_verifier('shouty')\n"
        "def shouty(completions, **_):\n    return [float(c.isupper()) for c in completions]\n"
    )
    plugin_module(tmp_path, monkeypatch, "my_rm_plugin", shouty)
    assert load_plugins(["my_rm_plugin", " "]) == ["my_rm_plugin"]
    assert "shouty" in verifier_names() and run("shouty", ["HI", "hi"]) == [1.0, 0.0]
    with pytest.raises(ImportError, match="BURSTRL_REWARD_PLUGINS"):
        load_plugins(["no_such_plugin_mod"])
    sys.modules.pop("my_rm_plugin", None)


def test_scored_survives_pickling() -> None:
    import pickle

    s = pickle.loads(pickle.dumps(Scored(0.0, "wall_time_limit")))
    assert s == 0.0 and s.reason == "wall_time_limit"
