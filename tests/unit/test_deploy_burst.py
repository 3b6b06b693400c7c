"""deploy/burst/: the rented trainer's recipe refuses plaintext or pod-local endpoints (and a
budget too short to checkpoint) before touching the network, and supervises its trainer and its
rollout replica (stand-ins for what the image runs).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.deploy import check_env_names, dotenv

BURST = ROOT / "deploy" / "burst" / "start-trainer.sh"
BURST_ENV = {
    "REDIS_URL": "rediss://:secretpassword@home.example.net:6380/0",
    "STORE_URL": "s3://burstrl/runs",
    "STORE_ENDPOINT_URL": "https://home.example.net:9443",
    "AWS_ACCESS_KEY_ID": "burstrl",
    "AWS_SECRET_ACCESS_KEY": "0123456789abcdef0123",
    "BURSTRL_TOKEN": "0123456789abcdef0123456789abcdef",
    "PATH": "/usr/bin:/bin",
}


REPLICA = {
    "BURST_HOURS": "10",
    "BURST_ROLLOUT": "1",
    "BURSTRL_ROLLOUT_MODEL": "Qwen/Qwen2.5-1.5B",
    "BURST_ROLLOUT_MEMORY_SHARE": "0.3",
    "BURST_TRAINER_GB": "90",
}


def run_burst(**over: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in {**BURST_ENV, **over}.items() if v is not None}
    return subprocess.run(["bash", str(BURST)], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"REDIS_URL": "redis://:pw@home.example.net:6379/0"}, "rediss://"),
        ({"REDIS_URL": "rediss://home.example.net:6380/0"}, "no password"),
        ({"REDIS_URL": "rediss://:pw@127.0.0.1:6380/0"}, "this box"),
        ({"STORE_ENDPOINT_URL": "http://home.example.net:9000"}, "https://"),
        ({"STORE_URL": "file:///workspace/store"}, "dies with the pod"),
        ({"BURSTRL_TOKEN": ""}, "BURSTRL_TOKEN is required"),
        ({}, "BURST_HOURS is required"),  # no time budget given
        ({"BURST_HOURS": "0.25"}, "too short"),  # 15 minutes minus the 20-minute margin
        ({"BURSTRL_TRAINER_TIME_BUDGET_S": "300"}, "too short"),
        ({"BURST_HOURS": "ten"}, "number of hours"),
        # A rollout replica beside the trainer: the flag, the model and both shares of the card.
        ({"BURST_HOURS": "10", "BURST_ROLLOUT": "yes"}, "BURST_ROLLOUT must be 0 or 1"),
        ({"BURST_HOURS": "10", "BURST_ROLLOUT": "1"}, "BURSTRL_ROLLOUT_MODEL is required"),
        ({"BURST_HOURS": "10", "BURST_ROLLOUT": "1", "BURSTRL_ROLLOUT_MODEL": "m"}, "BURST_ROLLOUT_MEMORY_SHARE is"),
        *(
            (
                {**REPLICA, "BURST_ROLLOUT_MEMORY_SHARE": bad},
                "BURST_ROLLOUT_MEMORY_SHARE must be a fraction of the card in (0, 1]",
            )
            for bad in ("0", "1.5", "-0.3", "nan", "0.")
        ),
        *(
            ({**REPLICA, "BURST_TRAINER_GB": bad}, "BURST_TRAINER_GB must be a positive number of GB")
            for bad in ("0", "-3", "inf", "lots")
        ),
        (REPLICA, "needs vLLM, which this image lacks"),  # the plain trainer image
    ],
)
def test_burst_recipe_refuses_what_a_stopped_rental_would_lose(over: dict[str, str], says: str) -> None:
    out = run_burst(**over)
    assert out.returncode == 2 and says in out.stderr, out.stderr


# Stand-ins for what the burst image runs, so the recipe's supervision runs for real: `python`
# answers the vLLM check and the preflight, and as `-m services.rollout` records its environment
# and the signal it gets; `torchrun` trains for a moment (or until SIGTERM).
FAKE_PYTHON = """#!/usr/bin/env bash
case "$1 $2" in
  "-c import vllm") exit 0 ;;
  "- ") cat >/dev/null; echo "burst: Redis and the store are reachable"; exit 0 ;;
  "-m services.rollout")
    env | grep -E '^BURSTRL_(REPLICA|PORT|ROLLOUT_GPU_MEMORY_UTILIZATION|ROLLOUT_TRAINER_RESERVE_GB)=' | sort >"$OUT/rollout.env"
    trap 'echo TERM >>"$OUT/rollout.log"; exit 0' TERM
    while :; do sleep 0.1; done ;;
esac
exit 1
"""
FAKE_TORCHRUN = """#!/usr/bin/env bash
trap 'echo TERM >>"$OUT/trainer.log"; exit 0' TERM
for _ in $(seq 1 "${TRAIN_TICKS:-10}"); do sleep 0.1; done
echo done >>"$OUT/trainer.log"
"""


def _fake_image(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("torchrun", FAKE_TORCHRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**REPLICA, "PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path), "BURSTRL_DATA_DIR": str(tmp_path)}


def test_burst_recipe_stops_its_replica_when_the_trainer_ends(tmp_path: Path) -> None:
    env = {**BURST_ENV, **_fake_image(tmp_path)}
    out = subprocess.run(["bash", str(BURST)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "trainer.log").read_text() == "done\n"  # the trainer ran its course
    assert (tmp_path / "rollout.log").read_text() == "TERM\n"  # then the replica was told to leave
    given = (tmp_path / "rollout.env").read_text().splitlines()
    assert "BURSTRL_ROLLOUT_GPU_MEMORY_UTILIZATION=0.3" in given and "BURSTRL_ROLLOUT_TRAINER_RESERVE_GB=90" in given
    assert "BURSTRL_PORT=8701" in given and any(g.startswith("BURSTRL_REPLICA=burst-") for g in given)


def test_burst_recipe_hands_sigterm_to_the_trainer_and_its_replica(tmp_path: Path) -> None:
    env = {**BURST_ENV, **_fake_image(tmp_path), "TRAIN_TICKS": "600"}
    proc = subprocess.Popen(["bash", str(BURST)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 30
        while not (tmp_path / "rollout.env").exists() and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the trap is set right after both start
        proc.send_signal(signal.SIGTERM)  # the provider stops the pod
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / "trainer.log").read_text() == "TERM\n"
    assert "TERM" in (tmp_path / "rollout.log").read_text()


def test_burst_recipe_shape() -> None:
    for script in (BURST, ROOT / "deploy" / "burst" / "make-certs.sh"):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = BURST.read_text()
    assert "export BURSTRL_TRAINER_TIME_BUDGET_S" in text
    last = [line for line in text.splitlines() if line.startswith("exec ")][-1]
    assert "torchrun" in last and last.endswith("-m services.trainer"), "exec: SIGTERM must reach the trainer"
    env = dotenv(ROOT / "deploy" / "burst" / "trainer.env.example")
    assert env["REDIS_URL"].startswith("rediss://") and env["STORE_ENDPOINT_URL"].startswith("https://")
    check_env_names(list(env), "deploy/burst/trainer.env.example")
