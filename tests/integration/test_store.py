"""Object store and policy versions: file:// and S3 through a real S3-protocol server."""

import pytest

from shared.policy import Manifest, VerificationError, fetch_version, latest_version, publish_version
from shared.store import FileStore, StoreError, folder_file, open_store
from tests.support.servers import make_bucket


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(f"file://{tmp_path}/store")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"b{abs(hash(str(tmp_path))) % 10**8}"
    make_bucket(endpoint, bucket)
    return open_store(f"s3://{bucket}/burstrl")


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
