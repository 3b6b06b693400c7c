"""Object store and policy versions: file:// and S3 through a real S3-protocol server."""

import pytest

from shared.folders import folder_file, put_manifest
from shared.policy import Manifest, VerificationError, fetch_version, latest_version, publish_version
from shared.store import FileStore, ObjectExists, StoreError, open_store
from tests.support.servers import make_bucket


@pytest.fixture
def store(file_or_s3_store):
    return file_or_s3_store


def test_put_get_list(store):
    store.put("a/b/c.bin", b"123")
    store.put("a/d.bin", b"4")
    assert store.get("a/b/c.bin") == b"123"
    assert store.list("a/") == ["a/b/c.bin", "a/d.bin"]
    assert store.exists("a/d.bin") and not store.exists("a/nope")
    with pytest.raises(StoreError):
        store.get("a/nope")


def test_version_is_verified_and_immutable(store, tmp_path):
    m = Manifest(job_id="j", version=1, step=1, base_model="m", files={})
    publish_version(store, m, {"adapter_model.safetensors": b"w" * 100, "adapter_config.json": b"{}"})
    assert latest_version(store, "j") == 1
    got = fetch_version(store, "j", 1, tmp_path / "v1")
    assert (tmp_path / "v1" / "adapter_model.safetensors").read_bytes() == b"w" * 100
    assert set(got.files) == {"adapter_model.safetensors", "adapter_config.json"}
    with pytest.raises(StoreError, match="immutable"):
        publish_version(store, Manifest(job_id="j", version=1, step=1, base_model="m", files={}), {"x": b""})
    store.put(folder_file(store, "jobs/j/policy/v1", "adapter_model.safetensors"), b"corrupt")
    with pytest.raises(VerificationError):
        fetch_version(store, "j", 1, tmp_path / "v1b")


def test_put_new_writes_only_where_no_object_is(store, tmp_path):
    """What a manifest's write builds on (shared/folders.py, put_manifest): S3's If-None-Match: *,
    a hard link on file://. The loser writes nothing and leaves nothing behind."""
    store.put_new("f/manifest.json", b"first")
    with pytest.raises(ObjectExists):
        store.put_new("f/manifest.json", b"second")
    assert store.get("f/manifest.json") == b"first"
    if isinstance(store, FileStore):
        assert [p.name for p in (tmp_path / "store" / "f").iterdir()] == ["manifest.json"]  # no temporary file


def test_delete_if_removes_only_the_write_it_read(store):
    """The live holder removes a deposed writer's manifest only while it is still the one it read."""
    store.put_new("f/manifest.json", b"deposed")
    _, read = store.get_tagged("f/manifest.json")
    store.delete("f/manifest.json")
    store.put_new("f/manifest.json", b"newer holder")  # replaced after our read
    assert not store.delete_if("f/manifest.json", read)
    assert store.get("f/manifest.json") == b"newer holder"
    _, tag = store.get_tagged("f/manifest.json")
    assert store.delete_if("f/manifest.json", tag) and not store.exists("f/manifest.json")
    assert not store.delete_if("f/manifest.json", tag)  # gone already


def test_a_manifest_is_written_once_unless_its_epoch_may_replace_it(store):
    """A retried PUT that had landed is this write; a segment's manifest (no epoch) is never replaced."""
    put_manifest(store, "ck", {"epoch": 1, "files": {}})
    put_manifest(store, "ck", {"epoch": 1, "files": {}})  # the same bytes: already written
    put_manifest(store, "seg", {"groups": 1, "files": {}})
    with pytest.raises(ObjectExists):
        put_manifest(store, "seg", {"groups": 2, "files": {}})


def test_a_store_that_ignores_conditional_writes_is_refused(s3_endpoint):
    """An S3-compatible server without If-None-Match (here: the header never reaches it) would let a
    deposed trainer's manifest replace its successor's, silently: the first manifest write says so."""
    make_bucket(s3_endpoint, "nocond")
    store = open_store("s3://nocond/burstrl")

    def drop_condition(request, **_: object) -> None:  # noqa: ANN001
        del request.headers["If-None-Match"]

    store.s3.meta.events.register("before-sign.s3.PutObject", drop_condition)
    with pytest.raises(StoreError, match="ignores If-None-Match"):
        store.put_new("f/manifest.json", b"x")
    assert not store.exists("f/manifest.json")


def test_version_without_manifest_does_not_exist(store):
    store.put("jobs/j/policy/v7/adapter_model.safetensors", b"partial upload")
    assert latest_version(store, "j") == -1


def test_file_store_rejects_escaping_keys(tmp_path):
    with pytest.raises(StoreError):
        FileStore(tmp_path).put("../outside", b"x")


def test_a_folder_being_written_keeps_its_temporary_file(tmp_path):
    """delete() removes a crashed write's stale temp file with its emptied folder, never a live one."""
    store = FileStore(tmp_path / "s")
    store.put("a/b/x", b"1")
    live = tmp_path / "s" / "a" / "b" / ".tmp-live"
    live.write_bytes(b"a write in progress")
    store.delete("a/b/x")
    assert live.exists() and store.list("a/") == []
