import msgspec
import numpy as np
import pytest

from shared.schema import Completion, GroupMsg, PromptMsg, decode, encode, pack_f32, pack_i32, unpack_f32, unpack_i32


def _group() -> GroupMsg:
    c = Completion(
        token_ids=pack_i32([5, 6, 0]),
        logprobs=pack_f32([-0.5, -1.25, -0.1]),
        loss_mask=bytes([1, 1, 1]),
        text="12",
        finish_reason="stop",
    )
    return GroupMsg(
        job_id="j",
        group_id="j:g0",
        item_id="1+2",
        prompt="1+2=",
        prompt_ids=pack_i32([1, 2]),
        policy_version=3,
        completions=[c],
    )


def test_group_roundtrip_keeps_packed_arrays_exact():
    g = decode(encode(_group()), GroupMsg)
    assert g.policy_version == 3
    assert unpack_i32(g.completions[0].token_ids).tolist() == [5, 6, 0]
    np.testing.assert_array_equal(unpack_f32(g.completions[0].logprobs), np.float32([-0.5, -1.25, -0.1]))


def test_decode_rejects_wrong_type_and_garbage():
    with pytest.raises(TypeError):
        decode(encode(PromptMsg(job_id="j", group_id="g", item_id="i", prompt="p")), GroupMsg)
    with pytest.raises(msgspec.DecodeError):
        decode(b"\xc1not msgpack", GroupMsg)
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"type": "group", "job_id": "j"}), GroupMsg)


def test_decode_rejects_future_schema_version():
    g = _group()
    g.v = 99
    with pytest.raises(TypeError, match="schema version"):
        decode(encode(g), GroupMsg)


def test_heartbeats_round_trip_and_reject_garbage():
    import msgspec

    from shared.schema import Heartbeat, decode_heartbeat, encode_heartbeat

    beat = Heartbeat(role="rollout", replica="r0", host="h", port=1, version="0", ready=False, at=1.0)
    beat.reasons = {"engine": "loading"}
    assert decode_heartbeat(encode_heartbeat(beat)) == beat
    newer = encode_heartbeat(beat)[:-1] + b',"new_gauge":3}'  # a newer service's extra gauge
    assert decode_heartbeat(newer) == beat
    for bad in (b"not json", b'{"role": "x"}', b'{"role":1,"replica":"r","host":"h","port":1,"version":"0"}'):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            decode_heartbeat(bad)


def test_turn_fields_round_trip_and_are_backward_compatible():
    g = _group()
    assert g.completions[0].turn_starts == b"" and g.completions[0].turn_rewards == b""  # single-turn
    g.completions[0].turn_starts = pack_i32([0, 2])
    g.completions[0].turn_rewards = pack_f32([-0.25, 0.0])
    c = decode(encode(g), GroupMsg).completions[0]
    assert unpack_i32(c.turn_starts).tolist() == [0, 2]
    np.testing.assert_array_equal(unpack_f32(c.turn_rewards), np.float32([-0.25, 0.0]))

    # A message from a writer that predates the fields decodes with them empty...
    raw = msgspec.msgpack.decode(encode(_group()))
    for rc in raw["completions"]:
        del rc["turn_starts"], rc["turn_rewards"]
    c = decode(msgspec.msgpack.encode(raw), GroupMsg).completions[0]
    assert c.turn_starts == b"" and c.turn_rewards == b""

    # ...and a reader that predates them ignores them (msgspec skips unknown fields).
    class OldCompletion(msgspec.Struct, kw_only=True):
        token_ids: bytes
        logprobs: bytes
        loss_mask: bytes
        text: str
        finish_reason: str

    assert msgspec.msgpack.decode(msgspec.msgpack.encode(g.completions[0]), type=OldCompletion).text == "12"


def test_a_job_record_keeps_the_errors_a_newer_one_replaced(r):
    """Issue 18: the job's error kept only the latest refusal."""
    import time

    from shared.job import ERROR_HISTORY, JobRecord, JobSpec, insert_job, load_job, update_job

    now = time.time()
    insert_job(r, JobRecord(id="j-1", spec=JobSpec(base_model="m"), created_at=now, updated_at=now))
    for i in range(ERROR_HISTORY + 3):
        update_job(r, "j-1", lambda rec, i=i: setattr(rec, "error", f"rollout: policy v{i} refused"))
    update_job(r, "j-1", lambda rec: setattr(rec, "error", ""))  # cleared: the last one joins the history
    rec = load_job(r, "j-1")
    assert rec.error == "" and len(rec.error_history) == ERROR_HISTORY
    assert rec.error_history[-1] == f"rollout: policy v{ERROR_HISTORY + 2} refused"
