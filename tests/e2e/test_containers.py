"""The images and compose files for real: podman, Compose v2, the images `make images` built.

In order (each step builds on the one before; `make test-containers` runs them with -x):
1. `docker compose --profile cpu up`: Redis (AOF), the S3 server, api, reward, ref, rollout, the
   trainer, every healthcheck healthy; then down -v.
2. The README's inference-box command, `docker compose up rollout ref reward`, as written (the
   override files come in through COMPOSE_FILE); a code reward runs sandboxed inside the reward
   container.
3. A trainer on a network of its own joins the way the burst does (deploy/burst/compose.burst.yaml,
   the burst recipe): Redis and the store only through compose.tls.yaml's TLS ports, certificates
   from make-certs.sh, the token; a wrong password or an untrusted CA is refused in its log.
4./5. A job submitted over HTTP completes, ledger balanced, while rollout is killed through compose,
   the trainer and Redis crash (kill -9 of their processes: the restart policies bring them back;
   Redis from its AOF volume, every acknowledged count kept).
6. `down`, then `up` on the same volumes: the job and its policy versions are still there.
Skipped unless selected with `-m containers`, and when podman, Compose v2 or the images are missing.
The MinIO, Caddy and Redis images come from docker/local/ (no registry here): compose.test*.yaml.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess

import httpx
import pytest

from services.cli.launch import free_port
from shared import keys
from shared.ledger import audit
from shared.ml.models import ensure_tiny_model
from shared.redis_conn import connect
from tests.support.compose import ROOT, Engine, Project, missing_tools, wait_for
from tests.support.jobs import arith_job

pytestmark = pytest.mark.containers

MODEL = ROOT / ".burstrl" / "models" / "tiny-sft"
# The sandbox checks' image; TEST_REWARD_IMAGE runs them against another build of it.
REWARD_IMAGE = os.environ.get("TEST_REWARD_IMAGE", "localhost/burstrl/reward:0.1.0")
HOME_FILES = ["compose.yaml", "compose.tls.yaml", "compose.test.yaml", "compose.test-tls.yaml"]
BURST_FILES = [ROOT / "deploy" / "burst" / "compose.burst.yaml", "compose.test-burst.yaml"]
JOB = arith_job(
    "containers",
    group=8,
    batch=4,
    steps=6,
    base_model="/opt/models/tiny-sft",  # where compose.test*.yaml mount the tiny model
    learning_rate=2e-3,
    kl_coef=0.001,  # the ref service takes part
    eval_size=16,
)
# Inside the reward container: the sandbox's own check, a code reward judged through it, and what
# the solution can see of the machine (no network; /proc of its own pid namespace or not).
SANDBOX_PROBE = r"""
import json
from shared.domain.sandbox import check_isolation, run_code, run_program
ok, why = check_isolation()
solved = run_code("print(int(input()) * 2)", [{"stdin": "21", "stdout": "42"}, {"stdin": "5", "stdout": "10"}])
seen = run_program("import os, socket\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]) "
                   "if os.path.isdir('/proc') else 'noproc')\n"
                   "s = socket.socket(); s.settimeout(1)\ntry:\n    s.connect(('redis', 6379)); print('net')\n"
                   "except OSError:\n    print('nonet')\n")
print(json.dumps({"ok": ok, "why": why, "passed": solved.passed, "seen": seen.stdout.split()}))
"""


def _selected(request) -> None:
    if "containers" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("container tests run only when selected: -m containers (make test-containers)")
    if why := missing_tools():
        pytest.skip(why)


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory):
    _selected(request)
    # The shipped tiny model, copied where the containers mount it (what `burstrl init-model` does):
    # on a fresh clone the stack's 8 tests were skipped for its absence, and the target passed.
    ensure_tiny_model(MODEL)
    tmp = tmp_path_factory.mktemp("containers")
    model = tmp / "tiny-sft"  # a copy the containers' uid 10001 may read (the shared one is 0600)
    shutil.copytree(MODEL, model)
    for f in [model, *model.iterdir()]:
        f.chmod(0o755 if f.is_dir() else 0o644)
    certs = ROOT / "deploy" / "burst" / "make-certs.sh"
    # The name the burst container dials (podman's name for the host), and the test's own client's.
    subprocess.run(
        ["bash", str(certs), "host.containers.internal", str(tmp / "tls"), "localhost"], check=True, capture_output=True
    )
    subprocess.run(["bash", str(certs), "elsewhere.example", str(tmp / "other-ca")], check=True, capture_output=True)
    s = {
        "BURSTRL_TOKEN": secrets.token_hex(32),
        "REDIS_PASSWORD": secrets.token_hex(24),
        "MINIO_ROOT_USER": "burstrl-root",
        "MINIO_ROOT_PASSWORD": secrets.token_hex(24),
        "STORE_ACCESS_KEY": "burstrl-services",
        "STORE_SECRET_KEY": secrets.token_hex(24),
    }
    ports = {"api": free_port(), "redis_tls": free_port(), "store_tls": free_port()}
    common = {
        **s,
        "STORE_BUCKET": "burstrl",
        "BURSTRL_MODEL": JOB["base_model"],
        "BURSTRL_MAX_MODEL_LEN": "256",  # the tiny model's context (compose's default, 2048, is Qwen's)
        "BURSTRL_IMAGE_TAG": "0.1.0",
        "TEST_MODEL_DIR": str(model),
        "TEST_API_PORT": str(ports["api"]),
        "TEST_REDIS_TLS_PORT": str(ports["redis_tls"]),
        "TEST_STORE_TLS_PORT": str(ports["store_tls"]),
        "TLS_DIR": str(tmp / "tls"),
    }
    burst_env = {
        "REDIS_URL": f"rediss://:{s['REDIS_PASSWORD']}@host.containers.internal:{ports['redis_tls']}/0",
        "STORE_URL": "s3://burstrl/runs",
        "STORE_ENDPOINT_URL": f"https://host.containers.internal:{ports['store_tls']}",
        "AWS_ACCESS_KEY_ID": s["STORE_ACCESS_KEY"],
        "AWS_SECRET_ACCESS_KEY": s["STORE_SECRET_KEY"],
        "BURSTRL_TOKEN": s["BURSTRL_TOKEN"],
        "BURST_CA_CERT": (tmp / "tls" / "ca.crt").read_text(),
        "BURSTRL_TRAINER_TIME_BUDGET_S": "7200",
        "TEST_MODEL_DIR": str(model),
    }
    engine = Engine(tmp)
    engine.start()
    prefix = f"brc{secrets.token_hex(3)}"
    # The burst's own network, made here (compose.test-burst.yaml says why), removed at the end.
    burst_env["TEST_BURST_NETWORK"] = f"{prefix}-burst-net"
    subprocess.run(["podman", "network", "create", burst_env["TEST_BURST_NETWORK"]], check=True, capture_output=True)
    projects = {
        "cpu": Project(engine, f"{prefix}-cpu", ["compose.yaml", "compose.test.yaml"], common),
        "home": Project(engine, f"{prefix}-home", HOME_FILES, common),
        "burst": Project(engine, f"{prefix}-burst", BURST_FILES, burst_env),
    }
    engine.watch_health([p.name for p in projects.values()])
    state = {"tmp": tmp, "secrets": s, "ports": ports, "api": f"http://127.0.0.1:{ports['api']}", **projects}
    try:
        yield state
    finally:
        for p in projects.values():
            p.down("-v")
        subprocess.run(["podman", "network", "rm", "-f", burst_env["TEST_BURST_NETWORK"]], capture_output=True)
        engine.stop()


def _redis(stack):
    ca = stack["tmp"] / "tls" / "ca.crt"
    pw, port = stack["secrets"]["REDIS_PASSWORD"], stack["ports"]["redis_tls"]
    return connect(f"rediss://:{pw}@localhost:{port}/0?ssl_ca_certs={ca}")


def _job(stack, job_id: str) -> dict:
    auth = {"Authorization": f"Bearer {stack['secrets']['BURSTRL_TOKEN']}"}
    return httpx.get(f"{stack['api']}/v1/jobs/{job_id}", headers=auth, timeout=10).json()


def test_compose_refuses_a_missing_secret_by_name(stack):
    empty = stack["tmp"] / "empty.env"
    empty.write_text("")
    out = stack["home"].run("--env-file", str(empty), "config", check=False, env={"BURSTRL_TOKEN": ""})
    assert out.returncode != 0 and "BURSTRL_TOKEN" in out.stderr, out.stderr


def test_cpu_profile_every_healthcheck_healthy(stack):
    cpu: Project = stack["cpu"]
    cpu.foreground("--profile", "cpu", "up")
    services = ["redis", "minio", "api", "reward", "rollout-cpu", "ref-cpu", "trainer-cpu"]
    cpu.wait_healthy(services, timeout=1200)
    assert cpu.completed("init-model") and cpu.completed("minio-init")
    aof = cpu.run("exec", "-T", "redis", "redis-cli", "config", "get", "appendonly").stdout.split()
    assert aof == ["appendonly", "yes"]
    cpu.down("-v")


def test_inference_box_command_as_written_and_sandboxed_code_rewards(stack):
    home: Project = stack["home"]
    home.foreground("up", "rollout", "ref", "reward")
    home.wait_healthy(["redis", "minio", "rollout", "ref", "reward"], timeout=1200)
    started = set(home.health())
    assert started == {"redis", "minio", "minio-init", "rollout", "ref", "reward"}, started
    probe = json.loads(home.run("exec", "-T", "reward", "python", "-c", SANDBOX_PROBE).stdout.splitlines()[-1])
    assert probe["ok"], probe["why"]
    assert probe["passed"] == 2, probe
    assert probe["seen"][-1] == "nonet", probe  # the reward container reaches redis; its sandbox does not
    # The rest of the home box for the burst: the api, and the TLS proxy in front of the store.
    home.run("up", "-d", "api", "store-tls")
    home.wait_healthy(["api", "store-tls"], timeout=300)


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"REDIS_URL": "wrong-password"}, "refused the credentials in REDIS_URL"),
        ({"BURST_CA_CERT": "other-ca"}, "certificate is not trusted"),
    ],
)
def test_burst_trainer_refuses_a_wrong_password_or_an_untrusted_certificate(stack, over, says):
    burst: Project = stack["burst"]
    env = {}
    if "REDIS_URL" in over:
        good = burst.env["REDIS_URL"]
        env["REDIS_URL"] = good.replace(stack["secrets"]["REDIS_PASSWORD"], secrets.token_hex(24))
    else:
        env["BURST_CA_CERT"] = (stack["tmp"] / "other-ca" / "ca.crt").read_text()
    out = burst.run_once("trainer", timeout=300, env=env)
    assert out.returncode != 0, out.stdout[-2000:]
    assert says in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]


def test_burst_trainer_joins_over_tls_from_its_own_network(stack):
    burst: Project = stack["burst"]
    burst.run("up", "-d")
    burst.wait_healthy(["trainer"], timeout=600)
    said = "burst: Redis and the store are reachable"
    try:
        wait_for(lambda: said in burst.engine_logs("trainer"), 60, "the preflight's line in the trainer's log")
    except TimeoutError as e:
        raise AssertionError(f"{e}:\n{burst.engine_logs('trainer')[-4000:]}") from None
    # Its own network: the home box's services are not even names there.
    out = burst.run(
        "exec", "-T", "trainer", "python", "-c", "import socket; socket.getaddrinfo('redis', 6379)", check=False
    )
    assert out.returncode != 0 and "gaierror" in out.stderr, out.stderr


def test_job_over_http_survives_kills_and_balances_its_ledger(stack):
    home, burst = stack["home"], stack["burst"]
    auth = {"Authorization": f"Bearer {stack['secrets']['BURSTRL_TOKEN']}"}
    resp = httpx.post(f"{stack['api']}/v1/jobs", json=JOB, headers=auth, timeout=10)
    assert resp.status_code in (200, 201), resp.text
    job_id = resp.json()["id"]
    stack["job_id"] = job_id
    wait_for(lambda: _job(stack, job_id)["policy_version"] >= 1, 900, "policy v1", every=5)

    # rollout, through compose. A kill through the engine counts as a manual stop for the restart
    # policy (Docker and podman alike), so an operator brings it back: `up -d --no-deps`, since
    # `start` also re-runs the one-shot minio-init it depends on, whose end compose then misread
    # on podman ("didn't complete successfully: exit 1").
    home.run("kill", "rollout")
    home.run("up", "-d", "--no-deps", "rollout")
    # The trainer crashes (its process killed on the host): `restart: on-failure` brings it back and
    # it resumes from its newest checkpoint in the store.
    before = burst.restarts("trainer")
    subprocess.run(["kill", "-9", str(burst.host_pid("trainer"))], check=True)
    wait_for(lambda: burst.restarts("trainer") > before, 120, "the trainer restarted by its policy")
    # Redis crashes: `unless-stopped` restarts it from its AOF volume; no acknowledged count is lost.
    r = _redis(stack)
    counted = {k.decode(): int(v) for k, v in r.hgetall(keys.ledger(job_id)).items()}
    r.close()
    redis_restarts = home.restarts("redis")
    subprocess.run(["kill", "-9", str(home.host_pid("redis"))], check=True)
    wait_for(lambda: home.restarts("redis") > redis_restarts, 120, "Redis restarted by its policy")
    home.wait_healthy(["redis"], timeout=120)
    r = _redis(stack)
    after = {k.decode(): int(v) for k, v in r.hgetall(keys.ledger(job_id)).items()}
    assert all(after.get(k, 0) >= v for k, v in counted.items()), (counted, after)

    final = wait_for(
        lambda: (lambda s: s if s["job"]["state"] == "completed" else None)(_job(stack, job_id)),
        1500,
        "the job to complete",
        every=5,
    )
    a = audit(r, job_id)
    r.close()
    assert a.balanced, a.problems
    assert final["policy_version"] == JOB["steps"]
    assert final["ledger"]["trained"] == JOB["steps"] * JOB["batch_size"]
    assert home.restarts("rollout") >= 0 and burst.restarts("trainer") >= 1


def test_down_then_up_keeps_jobs_and_policy_versions(stack):
    home, burst = stack["home"], stack["burst"]
    job_id = stack.get("job_id")
    assert job_id, "the job test must run first"
    burst.down()
    home.down()
    assert not home.containers()
    home.run("up", "-d", "api", "rollout", "ref", "reward", "store-tls")
    home.wait_healthy(["redis", "minio", "api", "rollout", "ref", "reward"], timeout=1200)
    got = _job(stack, job_id)
    assert got["job"]["state"] == "completed" and got["policy_version"] == JOB["steps"], got
    listing = home.run(
        "exec",
        "-T",
        "api",
        "python",
        "-c",
        f"import os; from shared.store import open_store; print('\\n'.join(open_store(os.environ['STORE_URL']).list('jobs/{job_id}/policy')))",
    ).stdout.split()
    versions = {k.split("/")[3] for k in listing if k.endswith("/manifest.json")}
    assert {f"v{v}" for v in range(1, JOB["steps"] + 1)} <= versions, sorted(versions)


# Docker's default seccomp profile, as far as namespaces go: unshare, and clone with CLONE_NEWUSER, are
# refused to a process without CAP_SYS_ADMIN (clone3 answers ENOSYS, so glibc falls back to clone).
NO_USERNS_SECCOMP = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "syscalls": [
        {"names": ["unshare"], "action": "SCMP_ACT_ERRNO"},
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ERRNO",
            "args": [{"index": 0, "value": 0x10000000, "valueTwo": 0x10000000, "op": "SCMP_CMP_MASKED_EQ"}],
        },
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
    ],
}


@pytest.mark.parametrize(
    ("opts", "isolated", "says"),
    [
        # The engine's defaults: podman's seccomp profile allows user namespaces, but /proc is masked,
        # and the sandbox refuses rather than run without a /proc of its own (docs/sandbox.md).
        ([], False, "mount /proc: Operation not permitted"),
        (["--security-opt", "unmask=/proc/*"], True, "private /proc"),  # Docker: systempaths=unconfined
        (["-e", "BURSTRL_SANDBOX_PROC=off"], True, "no /proc"),
        # Docker's default seccomp profile refuses the namespaces: refused, never run unsandboxed.
        (["--security-opt", "unmask=/proc/*", "--security-opt", "seccomp={profile}"], False, "unshare failed"),
    ],
    ids=["engine-default", "unmasked-proc", "proc-off", "no-userns-seccomp"],
)
def test_what_the_reward_container_needs_for_code_rewards(request, tmp_path, opts, isolated, says):
    """As the image's non-root uid, all capabilities dropped, no-new-privileges, never --privileged."""
    _selected(request)
    profile = tmp_path / "no-userns.json"
    profile.write_text(json.dumps(NO_USERNS_SECCOMP))
    name = f"brc{secrets.token_hex(3)}-sandbox"
    out = subprocess.run(
        ["podman", "run", "--rm", "--name", name, "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
        + [o.format(profile=profile) for o in opts]
        + ["-e", "BURSTRL_SANDBOX_PYTHON=/usr/local/bin/python3", REWARD_IMAGE]
        + ["python", "-c", SANDBOX_PROBE.replace("'redis'", "'10.0.0.1'")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    text = out.stdout + out.stderr
    assert says in text, text[-3000:]
    if not isolated:
        assert '"ok": true' not in out.stdout, out.stdout
        return
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.splitlines()[-1])
    assert probe["ok"] and probe["passed"] == 2 and probe["seen"][-1] == "nonet", probe
