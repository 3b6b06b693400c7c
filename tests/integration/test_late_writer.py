"""A deposed trainer's late writes never touch its successor's checkpoint or version
(docs/architecture.md, invariant 10), on a file:// store and on a real S3-protocol server (moto).

Files: trainer A is frozen in the middle of writing step 2 (after its first file); its lease
expires, B takes the job over and writes step 2 with other bytes; A wakes and writes its remaining
files. Before, those landed on B's files (seen on a checkpoint's optimizer file and a version's
adapter): B's manifest stopped matching, and B's checkpoint or version could not be read. The fence
refused A's manifest but not its data files. Now each writer's files go to a write-once subfolder
its own manifest names.

Manifests: A is frozen after its lease check, right before its manifest's PUT; B writes step 2 and
its manifest; A wakes. Before, A's PUT replaced B's manifest: readers refused it (the fence), and
B's checkpoint or version was gone. Now a manifest is written only where none is (shared/folders.py,
`put_manifest`): A gets LeaseLost and B's stays. In the other order (A's late manifest lands first),
B replaces it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import redis
import torch
from safetensors.torch import save

from services.trainer.checkpoint import OPTIMIZER, TrainState, ckpt_prefix, load_checkpoint, save_checkpoint
from services.trainer.publishing import Publisher
from shared import keys
from shared.fence import record_takeover
from shared.folders import MANIFEST, get_folder, put_folder
from shared.lease import Lease, LeaseLost
from shared.policy import DeposedWrite, Manifest, fetch_version, make_probe, publish_version, version_prefix
from shared.store import ObjectStore

JOB = "late-1"


@pytest.fixture
def store(file_or_s3_store: ObjectStore) -> ObjectStore:
    return file_or_s3_store


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
    raised, _, _ = _a_frozen_while_b(
        r, store, FrozenAfterFirst(store, prefix), write, lambda b, b_check: write(store, b, b_check)
    )
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


# -- the manifest itself: written only where none is -------------------------------------------------
class FrozenAtManifest:
    """`store` for writer A: A freezes (`frozen` is set) at its first write or delete of the manifest
    under `prefix` (its lease check already passed), until `thaw` is set."""

    def __init__(self, store: ObjectStore, prefix: str) -> None:
        self.store, self.key, self.url = store, f"{prefix}/{MANIFEST}", store.url
        self.frozen, self.thaw = threading.Event(), threading.Event()

    def _at(self, key: str) -> None:
        if key == self.key and not self.frozen.is_set():
            self.frozen.set()
            assert self.thaw.wait(60), "never thawed"

    def put(self, key: str, data: bytes) -> None:
        self._at(key)
        self.store.put(key, data)

    def put_new(self, key: str, data: bytes) -> None:
        self._at(key)
        self.store.put_new(key, data)

    def delete(self, key: str) -> None:
        self._at(key)
        self.store.delete(key)

    def delete_if(self, key: str, tag: str) -> bool:
        self._at(key)
        return self.store.delete_if(key, tag)

    def __getattr__(self, name: str):  # noqa: ANN204 (get, list, exists, ... as the real store)
        return getattr(self.store, name)


def _frozen_at_manifest(
    r: redis.Redis,
    store: ObjectStore,
    prefix: str,
    write_a: Callable[[ObjectStore, Lease, Callable], None],
    meanwhile: Callable[[Lease, Callable], None],
) -> tuple[list[BaseException], Lease, Callable[[], None]]:
    """A writes through a store that freezes it right before its manifest; meanwhile its lease
    expires, B takes the job over and runs `meanwhile`; then A wakes. Returns what A raised, and
    B's lease and lease check."""
    return _a_frozen_while_b(r, store, FrozenAtManifest(store, prefix), write_a, meanwhile)


def _a_frozen_while_b(
    r: redis.Redis,
    store: ObjectStore,
    frozen: FrozenAfterFirst | FrozenAtManifest,
    write_a: Callable[[ObjectStore, Lease, Callable], None],
    meanwhile: Callable[[Lease, Callable], None],
) -> tuple[list[BaseException], Lease, Callable[[], None]]:
    """A writes through `frozen` until it freezes; its lease expires, B takes the job over and runs
    `meanwhile`; then A wakes. Returns what A raised, and B's lease and lease check."""
    a, a_check = _holder(r, store, "a")
    raised: list[BaseException] = []

    def run_a() -> None:
        try:
            write_a(frozen, a, a_check)  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            raised.append(e)

    th = threading.Thread(target=run_a)
    th.start()
    assert frozen.frozen.wait(60), "A never reached the write it freezes at"
    r.delete(keys.trainer_lease(JOB))  # A's lease expired while it was frozen
    b, b_check = _holder(r, store, "b")
    assert b.epoch > a.epoch
    meanwhile(b, b_check)
    frozen.thaw.set()
    th.join(60)
    assert not th.is_alive()
    return raised, b, b_check


CKPT_FILES = {"a": {"adapter_model.safetensors": b"A weights"}, "b": {"adapter_model.safetensors": b"B weights"}}
GRADS = {"a": 1.0, "b": -3.0}


def _save(s: ObjectStore, lease: Lease, check: Callable[[], None]) -> None:
    who = lease.token[0]
    state = TrainState(step=2, trained_groups=[f"{who}-g1"], data={"groups_trained": 4})
    save_checkpoint(s, JOB, state, CKPT_FILES[who], _optimizer(GRADS[who]), epoch=lease.epoch, before_manifest=check)


def _assert_bs_checkpoint(store: ObjectStore, b: Lease) -> None:
    ck = load_checkpoint(store, JOB, 2)  # every hash and the fence checked
    assert ck.files == CKPT_FILES["b"] and ck.state.trained_groups == ["b-g1"]
    want = _optimizer(GRADS["b"]).state_dict()["state"][0]["exp_avg"]
    assert torch.equal(ck.opt_tensors["state.0.exp_avg"], want)
    assert get_folder(store, ckpt_prefix(JOB, 2))[0]["epoch"] == b.epoch


def test_a_late_manifest_never_replaces_its_successors_checkpoint(r, store):
    """A passed its lease check and froze before its manifest; B checkpointed step 2. Before, A's
    manifest replaced B's: the fence refused it and B's checkpoint, its groups acknowledged, was gone."""
    raised, b, b_check = _frozen_at_manifest(
        r, store, ckpt_prefix(JOB, 2), _save, lambda b, check: _save(store, b, check)
    )
    _assert_bs_checkpoint(store, b)
    assert len(raised) == 1 and isinstance(raised[0], LeaseLost), raised
    assert f"epoch {b.epoch}" in str(raised[0])  # says why: a newer holder's manifest is there


def test_a_late_checkpoint_manifest_that_landed_first_is_replaced(r, store):
    """The other order: A's late manifest lands before B checkpoints step 2; B's replaces it."""
    raised, b, b_check = _frozen_at_manifest(r, store, ckpt_prefix(JOB, 2), _save, lambda b, check: None)
    assert raised == []  # A cannot know: its later fenced writes (the acknowledgement) fail
    a_meta = get_folder(store, ckpt_prefix(JOB, 2))[0]
    with pytest.raises(DeposedWrite):
        load_checkpoint(store, JOB, 2)
    _save(store, b, b_check)
    _assert_bs_checkpoint(store, b)
    assert store.list(f"{ckpt_prefix(JOB, 2)}/{a_meta['data_dir']}/") == []  # A's files went with its manifest


VERSION_FILES = {
    "a": {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"A weights"},
    "b": {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"B weights"},
}
PROBES = {"a": make_probe([1, 2, 3], [-1.0, -2.0]), "b": make_probe([1, 2, 3], [-3.0, -4.0])}


def _publisher(r: redis.Redis, store: ObjectStore, lease: Lease, check: Callable[[], None]) -> Publisher:
    return Publisher(store, r, JOB, "m", lease=lease, assert_lease=check, probe_tolerance=0.01)


def _assert_bs_version(store: ObjectStore, b: Lease, dest) -> None:  # noqa: ANN001
    m = fetch_version(store, JOB, 2, dest)  # every hash and the fence checked
    assert (dest / "adapter_model.safetensors").read_bytes() == b"B weights" and m.epoch == b.epoch


def test_a_late_manifest_never_replaces_its_successors_version(r, store, tmp_path):
    def publish(s: ObjectStore, lease: Lease, check: Callable[[], None]) -> None:
        who = lease.token[0]
        m = Manifest(job_id=JOB, version=2, step=2, base_model="m", files={}, probe=PROBES[who], epoch=lease.epoch)
        publish_version(s, m, VERSION_FILES[who], before_manifest=check)

    raised, b, _ = _frozen_at_manifest(
        r, store, version_prefix(JOB, 2), publish, lambda b, check: publish(store, b, check)
    )
    _assert_bs_version(store, b, tmp_path / "v2")
    assert len(raised) == 1 and isinstance(raised[0], LeaseLost), raised


def test_a_late_version_manifest_that_landed_first_is_published_again(r, store, tmp_path):
    """The other order: A's late v2 lands first; B's Publisher finds it deposed and replaces it."""

    def publish(s: ObjectStore, lease: Lease, check: Callable[[], None]) -> None:
        _publisher(r, s, lease, check).publish(2, VERSION_FILES["a"], PROBES["a"])

    raised, b, b_check = _frozen_at_manifest(r, store, version_prefix(JOB, 2), publish, lambda b, check: None)
    assert raised == []
    with pytest.raises(DeposedWrite):
        fetch_version(store, JOB, 2, tmp_path / "a")
    assert _publisher(r, store, b, b_check).publish(2, VERSION_FILES["b"], PROBES["b"]) is not None
    _assert_bs_version(store, b, tmp_path / "v2")


def test_a_deposed_publisher_replacing_a_corrupt_version_never_removes_its_successors(r, store, tmp_path):
    """The Publisher's replace path: A finds v2 corrupt and sets out to publish it again, then freezes;
    B does the same and publishes v2. Before, A woke and deleted B's manifest (it had decided to
    replace the corrupt one): v2 was gone. Now A's replacement yields to B's newer epoch."""
    put_folder(store, version_prefix(JOB, 2), {"adapter_model.safetensors": b"x"}, {"job_id": JOB, "version": 2})
    store.put(f"{version_prefix(JOB, 2)}/adapter_model.safetensors", b"bit rot")

    def publish(s: ObjectStore, lease: Lease, check: Callable[[], None]) -> None:
        who = lease.token[0]
        _publisher(r, s, lease, check).publish(2, VERSION_FILES[who], PROBES[who])

    raised, b, _ = _frozen_at_manifest(
        r, store, version_prefix(JOB, 2), publish, lambda b, check: publish(store, b, check)
    )
    _assert_bs_version(store, b, tmp_path / "v2")
    assert len(raised) == 1 and isinstance(raised[0], LeaseLost), raised


def test_a_late_tinker_save_never_replaces_its_successors_state(r, store, tiny_model):
    """The Tinker worker's save_state: A froze before its manifest while B saved the same name; the
    state's files sat beside its manifest, so A's manifest named B's files with A's hashes, and the
    state could never load. Saving a name again (the same holder) still replaces it."""
    from services.trainer.settings import TrainerSettings
    from services.trainer.tinker.model import TinkerModel, named_state_prefix
    from shared.job import JobRecord, JobSpec, JobState

    spec = JobSpec(name="t", base_model=str(tiny_model), tinker=True, lora_rank=4)
    rec = JobRecord(id=JOB, spec=spec, state=JobState.running, created_at=0.0, updated_at=0.0)
    models = {who: TinkerModel(rec, TrainerSettings(dev=True), "cpu") for who in "ab"}
    with torch.no_grad():
        for p in models["b"].params:
            p.add_(0.01)  # B's weights differ from A's
    prefix = named_state_prefix(JOB, "mine")

    def save(s: ObjectStore, lease: Lease, check: Callable[[], None]) -> None:
        models[lease.token[0]].save_named(s, "mine", 3, epoch=lease.epoch, before_manifest=check)

    raised, b, b_check = _frozen_at_manifest(r, store, prefix, save, lambda b, check: save(store, b, check))
    meta, files = get_folder(store, prefix)  # every hash checked
    assert (
        meta["epoch"] == b.epoch
        and files["adapter_model.safetensors"] == models["b"].files()["adapter_model.safetensors"]
    )
    assert len(raised) == 1 and isinstance(raised[0], LeaseLost), raised
    save(store, b, b_check)  # the same name again: B's own state replaced, its old files gone
    again = get_folder(store, prefix)[0]
    assert again["data_dir"] != meta["data_dir"] and store.list(f"{prefix}/{meta['data_dir']}/") == []
    models["a"].load_named(store, JOB, "mine", optimizer=True)
