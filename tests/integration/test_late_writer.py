"""A deposed trainer's late file writes never touch its successor's checkpoint or version
(docs/architecture.md, invariant 10), on a file:// store and on a real S3-protocol server (moto).

Trainer A is frozen in the middle of writing step 2 (after its first file); its lease expires,
B takes the job over and writes step 2 with other bytes; A wakes and writes its remaining files.
Before, those landed on B's files (seen on a checkpoint's optimizer file and a version's adapter):
B's manifest stopped matching, and B's checkpoint or version could not be read. The fence refused
A's manifest but not its data files. Now each writer's files go to a write-once subfolder its own
manifest names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import redis
import torch
from safetensors.torch import save

from services.trainer.checkpoint import OPTIMIZER, TrainState, load_checkpoint, save_checkpoint
from shared import keys
from shared.fence import record_takeover
from shared.lease import Lease, LeaseLost
from shared.policy import Manifest, fetch_version, publish_version, version_prefix
from shared.store import ObjectStore, get_folder, open_store, put_folder
from tests.support.servers import make_bucket

JOB = "late-1"


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> ObjectStore:  # noqa: ANN001
    if request.param == "file":
        return open_store(f"file://{tmp_path}/store")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"late{abs(hash(str(tmp_path))) % 10**8}"
    make_bucket(endpoint, bucket)
    return open_store(f"s3://{bucket}/burstrl")


class FrozenAfterFirst:
    """`store` for writer A: its first write under `prefix` lands, then A freezes (`frozen` is set)
    until `thaw` is set, as a SIGSTOPped process would between two PUTs."""

    def __init__(self, store: ObjectStore, prefix: str) -> None:
        self.store, self.prefix, self.url = store, prefix, store.url
        self.frozen, self.thaw = threading.Event(), threading.Event()
        self.writes = 0

    def put(self, key: str, data: bytes) -> None:
        if key.startswith(self.prefix + "/") and self.writes == 1:
            self.frozen.set()
            assert self.thaw.wait(60), "never thawed"
        self.store.put(key, data)
        self.writes += key.startswith(self.prefix + "/")

    def __getattr__(self, name: str):  # noqa: ANN204 (get, list, exists, ... as the real store)
        return getattr(self.store, name)


def _holder(r: redis.Redis, store: ObjectStore, owner: str) -> tuple[Lease, Callable[[], None]]:
    """A trainer's lease, taken as claim_job takes it (the takeover recorded in the store first),
    and its check before a manifest."""
    lease = Lease(r, JOB, owner, ttl_s=60)
    assert lease.acquire()
    record_takeover(store, JOB, lease.epoch, lease.token, version=-1, checkpoint=-1)

    def still_held() -> None:
        if not lease.held():
            raise LeaseLost(f"{owner} lost the lease")

    return lease, still_held


def _race(r: redis.Redis, store: ObjectStore, prefix: str, write: Callable[[ObjectStore, Lease, Callable], None]):
    """A writes through a store that freezes it after its first file; meanwhile its lease expires
    and B writes the same folder; then A wakes. Returns what A raised."""
    a, a_check = _holder(r, store, "a")
    frozen = FrozenAfterFirst(store, prefix)
    raised: list[BaseException] = []

    def run_a() -> None:
        try:
            write(frozen, a, a_check)  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            raised.append(e)

    th = threading.Thread(target=run_a)
    th.start()
    assert frozen.frozen.wait(60), "A never reached its second file"
    r.delete(keys.trainer_lease(JOB))  # A's lease expired while it was frozen
    b, b_check = _holder(r, store, "b")
    assert b.epoch > a.epoch
    write(store, b, b_check)
    frozen.thaw.set()
    th.join(60)
    return raised


def _optimizer(value: float) -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.full((4,), value)
    opt.step()
    return opt


def test_a_late_writer_never_overwrites_its_successors_checkpoint(r, store):
    """Seen on the checkpoint's optimizer file: A's landed on B's after B's manifest."""
    files = {"a": {"adapter_model.safetensors": b"A weights"}, "b": {"adapter_model.safetensors": b"B weights"}}
    grads = {"a": 1.0, "b": -3.0}

    def write(s: ObjectStore, lease: Lease, check: Callable[[], None]) -> None:
        who = "a" if lease.token.startswith("a/") else "b"
        state = TrainState(step=2, trained_groups=[f"{who}-g1"], data={"groups_trained": 4})
        save_checkpoint(s, JOB, state, files[who], _optimizer(grads[who]), epoch=lease.epoch, before_manifest=check)

    raised = _race(r, store, f"jobs/{JOB}/trainer/step-00000002", write)
    assert len(raised) == 1 and isinstance(raised[0], LeaseLost), raised  # A wrote no manifest
    ck = load_checkpoint(store, JOB, 2)  # every hash verified: B's files, untouched
    assert ck.files == files["b"] and ck.state.trained_groups == ["b-g1"]
    want = _optimizer(grads["b"]).state_dict()["state"][0]["exp_avg"]
    assert torch.equal(ck.opt_tensors["state.0.exp_avg"], want)
    assert OPTIMIZER in get_folder(store, f"jobs/{JOB}/trainer/step-00000002")[1]


def test_a_late_writer_never_overwrites_its_successors_version(r, store, tmp_path):
    """Seen on a version's adapter: A's landed on B's after B's manifest."""
    files = {
        "a": {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"A weights"},
        "b": {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"B weights"},
    }

    def write(s: ObjectStore, lease: Lease, check: Callable[[], None]) -> None:
        who = "a" if lease.token.startswith("a/") else "b"
        m = Manifest(job_id=JOB, version=2, step=2, base_model="m", files={}, epoch=lease.epoch)
        publish_version(s, m, files[who], before_manifest=check)

    raised = _race(r, store, version_prefix(JOB, 2), write)
    assert len(raised) == 1 and isinstance(raised[0], LeaseLost), raised
    m = fetch_version(store, JOB, 2, tmp_path / "v2")  # every hash and the fence checked
    assert (tmp_path / "v2" / "adapter_model.safetensors").read_bytes() == b"B weights" and m.epoch == 2


def test_folders_written_before_write_once_subfolders_still_load(r, store, tmp_path):
    """The layout before: files beside the manifest, no data_dir. Readers take both."""
    put_folder(
        store,
        version_prefix(JOB, 1),
        {"adapter_model.safetensors": b"old weights"},
        {"job_id": JOB, "version": 1, "step": 1, "base_model": "m", "epoch": 0},
    )
    fetch_version(store, JOB, 1, tmp_path / "v1")
    assert (tmp_path / "v1" / "adapter_model.safetensors").read_bytes() == b"old weights"
    opt = _optimizer(2.0)
    tensors = {"state.0.step": opt.state_dict()["state"][0]["step"]}
    put_folder(
        store,
        f"jobs/{JOB}/trainer/step-00000001",
        {
            "adapter_model.safetensors": b"old weights",
            OPTIMIZER: save(tensors),
            "state.json": b'{"step": 1, "trained_groups": [], "extra": {}, "param_groups": [], "scheduler": null}',
        },
        {"step": 1, "epoch": 0},
    )
    ck = load_checkpoint(store, JOB, 1)
    assert ck.state.step == 1 and ck.files == {"adapter_model.safetensors": b"old weights"}
    assert torch.equal(ck.opt_tensors["state.0.step"], tensors["state.0.step"])
